"""A real chat tokenizer built in-process (WordLevel over role markers and words, no downloads) and chat templates."""
from __future__ import annotations

from nbguard.testing import TINY_VOCAB

SPECIALS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
BOS_ID, EOS_ID = 1, 2

# One turn: "<|role|> content </s>"; the template renders the BOS token itself, as Llama 3's and Gemma's do.
_TURN = "<|{{ m['role'] }}|> {{ m['content'] }} </s>{{ ' ' }}"
WITH_GENERATION = (
    "{{ bos_token }} {% for m in messages %}{% if m['role'] == 'assistant' %}<|assistant|> {% generation %}"
    "{{ m['content'] }} </s>{% endgeneration %} {% else %}" + _TURN + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WITHOUT_GENERATION = WITH_GENERATION.replace("{% generation %}", "").replace("{% endgeneration %}", "")
# A generation block around every turn: the user's and the system's tokens are supervised too.
EVERYTHING_GENERATED = (
    "{{ bos_token }} {% generation %}{% for m in messages %}" + _TURN + "{% endfor %}{% endgeneration %}"
)
# Qwen3-style: the last assistant turn gets an empty think block, inside the generation block.
EMPTY_THINK = WITH_GENERATION.replace("{% generation %}{{ m['content'] }}",
                                      "{% generation %}<think> </think> {{ m['content'] }}")


def chat_tokenizer(template: str = WITH_GENERATION, add_bos: bool = False):
    """A PreTrainedTokenizerFast over role markers and words w8..w127, pad distinct from EOS."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), TINY_VOCAB - 1)})
    vocab["<pad>"] = TINY_VOCAB - 1
    backend = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                  pad_token="<pad>", padding_side="right")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[3:]})
    tok.add_bos_token = add_bos  # the post-processor adds <s> to every encode
    tok.chat_template = template
    return tok


def conversation(turns: int = 2, seed: int = 0) -> list[dict]:
    """A system prompt, then ``turns`` user/assistant exchanges of in-vocabulary words."""
    words = [f"w{i}" for i in range(8, 120)]
    k = seed * 7
    msgs = [{"role": "system", "content": " ".join(words[k:k + 3])}]
    for t in range(turns):
        base = k + 3 + t * 9
        msgs.append({"role": "user", "content": " ".join(words[base:base + 4])})
        msgs.append({"role": "assistant", "content": " ".join(words[base + 4:base + 9])})
    return msgs
