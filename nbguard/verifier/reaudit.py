"""Data and config fixes verified by a re-audit of a shadow of the trainer as built, not by a training step.

A fix with no step recipe (a tokenizer, collator, dataset, arguments or config change) is applied to a
shadow of the trainer: a shallow copy whose processing class and collator are deep copies made together
(a collator keeps pointing at the shadow's tokenizer; the model they reference is never copied), whose
args are a copy, whose list and dict attributes are copies, and, for a fix that sets model config
fields, whose model is a shallow copy with its own config (the modules and weights stay the user's).
The rules that raised the finding run again on that shadow, on batches from its own dataloader (its
collator, its processing class, TRL's prepared dataset). Gone: "verified"; still there: "not enough";
no shadow, or the fix or the rule raises: "not checked". No training step runs.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from .. import fixes
from ..auditor.context import AuditContext
from ..auditor.registry import RULES
from ..document.view import REAUDITED
from ..findings import Finding, jsonable
from ..fixes.registry import Target
from ..introspect.tokenizers import tokenizer_of
from .result import NOT_CHECKED, NOT_ENOUGH, VERIFIED, FixVerdict, Verification

# fixes that change the model only through config fields (a shadow model with its own config holds them)
CONFIG_ONLY = frozenset({"distinct-pad-token", "sync-pad-token-id", "enable-router-aux-loss"})
# plan-less fixes a re-audit cannot check, and why (the other "model" fixes change modules or weights)
NOT_REAUDITED = {
    "save-tokenizer": "it writes files beside the model: a re-audit of the trainer cannot show the saved artifact",
    "disable-cudnn-sdp": "it switches a process-wide torch backend, which no shadow can hold apart from the user's run",
    "non-reentrant-checkpointing": "it re-enables checkpointing on the model's modules, and a re-audit never copies "
                                   "the model",
}
REAUDIT_NOTE = ("data and config fixes were re-audited on a shadow of the trainer as built (its own batches, "
                "collator and processing class): no training step ran for them")
MODEL_REASON = ("it changes the model's modules or weights, and a re-audit never copies the model (nor is there a "
                "step recipe for it)")


def reauditable(fix_id: str) -> bool:
    """Whether ``fix_id`` is verified by a re-audit: it has no step recipe and acts on the data, the args, the
    trainer or config fields (a fix that changes modules, files or process state is left "not checked")."""
    fix = fixes.get(fix_id)
    if fix.plan is not None:
        return False
    return fix_id not in NOT_REAUDITED and (fix.needs in ("tokenizer", "trainer", "args") or fix_id in CONFIG_ONLY)


def why_not_reaudited(fix_id: str) -> str:
    return NOT_REAUDITED.get(fix_id, MODEL_REASON)


@dataclass
class Shadow:
    trainer: Any
    model: Any
    args: Any
    tokenizer: Any


def _config_shadow(model: Any) -> Any:
    """``model`` with its own config and generation config: its modules, parameters and buffers are the user's
    (the containers are copies, so assigning a top-level module or field on the shadow never reaches the model)."""
    shadow = copy.copy(model)
    for name in ("_modules", "_parameters", "_buffers"):
        if isinstance(vars(model).get(name), dict):
            shadow.__dict__[name] = dict(vars(model)[name])
    for name in ("config", "generation_config"):
        value = getattr(model, name, None)
        if value is not None:
            shadow.__dict__[name] = copy.deepcopy(value)
    return shadow


def build_shadow(trainer: Any, model: Any, args: Any, config: bool) -> Shadow:
    """A shadow the fix can change without touching the user's objects (see the module's docstring)."""
    shadow_model = _config_shadow(model) if config and model is not None else model
    shadow_args = copy.copy(args) if args is not None else None
    if trainer is None:
        return Shadow(None, shadow_model, shadow_args, None)
    shadow = copy.copy(trainer)
    for name, value in vars(trainer).items():  # a fix that edits a list in place (reward_funcs) edits the copy's
        if type(value) in (list, dict):
            shadow.__dict__[name] = copy.copy(value)
    # never copied: the model, the accelerator, the optimizer, the datasets (a fix replaces them on the shadow)
    memo: dict[int, Any] = {id(trainer): shadow, id(args): shadow_args}
    for name in ("model", "model_wrapped", "accelerator", "optimizer", "lr_scheduler", "train_dataset", "eval_dataset",
                 "ref_model", "reward_model", "callback_handler", "state"):
        value = vars(trainer).get(name)
        if value is not None:
            memo.setdefault(id(value), shadow_model if value is model else value)
    if model is not None:
        memo[id(model)] = shadow_model
    names = [n for n in ("processing_class", "tokenizer", "data_collator") if vars(trainer).get(n) is not None]
    copies = copy.deepcopy([vars(trainer)[n] for n in names], memo)  # one memo: the collator keeps the shadow's tokenizer
    for name, value in zip(names, copies):
        shadow.__dict__[name] = value
    if shadow_args is not None:
        shadow.__dict__["args"] = shadow_args
    for name in ("model", "model_wrapped"):
        if vars(trainer).get(name) is model and model is not None:
            shadow.__dict__[name] = shadow_model
    return Shadow(shadow, shadow_model, shadow_args, tokenizer_of(shadow))


def fix_cell(fix_id: str, options: dict[str, Any], names: dict[str, str]) -> tuple[str, str | None]:
    """(title, the cell) as the audit's own fix cells write it: a trainer's tokenizer is its processing_class."""
    fix = fixes.get(fix_id)
    try:
        return fix.title, fixes.code(fix_id, **names, **options)
    except Exception:  # a cell that needs a name the audit does not have (a trainer for a trainer fix)
        return fix.title, None


def _still_firing(rule_id: str, out: Any, fix_id: str, several: bool) -> list[Finding]:
    """The findings of ``rule_id`` that still stand: any of them for a rule that raised one finding, else those
    that offer ``fix_id`` (a rule that raised several, one per function or file, is judged on this fix's)."""
    found = [f for f in (out if isinstance(out, list) else [out] if out is not None else []) if isinstance(f, Finding)]
    return [f for f in found if f.rule == rule_id and (not several or fix_id in f.fixes)]


def _run_rules(rule_ids: list[str], ctx: AuditContext) -> dict[str, Any]:
    return {rule_id: RULES[rule_id].check(ctx) for rule_id in rule_ids}


def reaudit_verdicts(findings: list[Finding], fix_ids: list[str], options: dict[str, dict[str, Any]], *,
                     model: Any, trainer: Any, args: Any, batch: dict | None, hardware: Any,
                     names: dict[str, str], check_baseline: bool = False) -> list[FixVerdict]:
    """One verdict per fix in ``fix_ids`` (each plan-less): re-audited on a shadow, or "not checked" and why.

    The rules first run on the trainer itself (no fix) when the findings may come from elsewhere: a given batch,
    or ``check_baseline`` (a finding handed to ``nbguard.verify``); a rule quiet there cannot be cleared."""
    baseline: dict[str, Any] | None = None
    verdicts = []
    for fix_id in fix_ids:
        title, code = fix_cell(fix_id, options.get(fix_id, {}), names)
        verdict = FixVerdict(fix_id, NOT_CHECKED, "", dict(options.get(fix_id, {})), title, code)
        verdicts.append(verdict)
        if not reauditable(fix_id):
            verdict.reason = why_not_reaudited(fix_id)
            continue
        raised = [f for f in findings if fix_id in f.fixes and f.rule in RULES]
        rule_ids = list(dict.fromkeys(f.rule for f in raised))
        if not rule_ids:
            verdict.reason = "no audit rule offered it here, so there is no finding for a re-audit to clear"
            continue
        if trainer is None and fixes.get(fix_id).needs != "args":
            verdict.reason = ("there is no trainer to re-audit: its batches, collator and processing class are "
                              "what this fix changes (pass trainer= to the audit)")
            continue
        if trainer is not None and (batch is not None or check_baseline):  # does the trainer itself show it?
            if baseline is None:  # once, for every rule a re-audit here reads
                wanted = {f.rule for f in findings if f.rule in RULES and any(
                    x in fix_ids and reauditable(x) for x in f.fixes)}
                try:
                    baseline = _run_rules(sorted(wanted), AuditContext(model=model, trainer=trainer, args=args,
                                                                       hardware=hardware))
                except Exception as exc:
                    baseline = {"": exc}
            if isinstance(failed := baseline.get(""), Exception):
                verdict.reason = f"the rules raised on the trainer itself: {type(failed).__name__}: {failed}"
                continue
            quiet = [r for r in rule_ids if not _still_firing(r, baseline.get(r), fix_id, False)]
            if quiet:
                verdict.reason = (f"{', '.join(quiet)} does not fire on the trainer as built (its own batches) even "
                                  "without the fix, so a re-audit of the trainer cannot show what this fix changes")
                continue
        several = {r for r in rule_ids if sum(f.rule == r for f in findings) > 1}
        _reaudit(verdict, several, rule_ids, model, trainer, args, batch, hardware)
    return verdicts


def _reaudit(verdict: FixVerdict, several: set[str], rule_ids: list[str], model: Any, trainer: Any, args: Any,
             batch: dict | None, hardware: Any) -> None:
    """``several``: the rules that raised more than one finding (each judged on the findings offering this fix)."""
    fix_id = verdict.fix
    try:
        shadow = build_shadow(trainer, model, args, config=fix_id in CONFIG_ONLY)
    except Exception as exc:
        verdict.reason = f"a shadow of the trainer could not be built for the re-audit: {type(exc).__name__}: {exc}"
        return
    if fix_id == "distinct-pad-token" and _adds_a_token(shadow.tokenizer):
        verdict.reason = ("it would add a pad token and resize the model's embeddings, and a re-audit never copies "
                          "the model")
        return
    target = Target(model=shadow.model, trainer=shadow.trainer, args=shadow.args, tokenizer=shadow.tokenizer,
                    optimizer=getattr(shadow.trainer, "optimizer", None))
    try:
        changed = fixes.get(fix_id).apply(target, **verdict.options)  # not fixes.apply: nothing is recorded as applied
    except Exception as exc:
        verdict.reason = f"applying it to a shadow of the trainer raised {type(exc).__name__}: {exc}"
        return
    verdict.changes = jsonable(dict(changed or {}))
    ctx = AuditContext(model=shadow.model, trainer=shadow.trainer, args=shadow.args,
                       batch=None if trainer is not None else batch, hardware=hardware)
    try:
        outs = _run_rules(rule_ids, ctx)
    except Exception as exc:
        verdict.reason = f"{REAUDITED}: a rule raised on the shadow: {type(exc).__name__}: {exc}"
        return
    sample = ctx.__dict__.get("sample")  # read only when a rule looked at batches
    still = {r: _still_firing(r, outs[r], fix_id, r in several) for r in rule_ids}
    firing = {r: fs for r, fs in still.items() if fs}
    verdict.reaudit = {"rules": rule_ids, "batches": sample.to_evidence() if sample is not None else None,
                       "still_fires": {r: [f.title for f in fs] for r, fs in firing.items()}}
    if sample is not None and sample.source == "trainer" and not sample.batches:
        verdict.verdict = NOT_ENOUGH
        verdict.reason = (f"{REAUDITED}: its dataloader gives no batch under it"
                          + (f" ({sample.error})" if sample.error else f" ({sample.note})" if sample.note else ""))
    elif firing:
        verdict.verdict = NOT_ENOUGH
        verdict.reason = f"{REAUDITED}: " + "; ".join(
            f"{r} still fires: {fs[0].title}" for r, fs in firing.items())
        if not changed:
            verdict.reason += " (it changes nothing on the trainer as built)"
    else:
        verdict.verdict = VERIFIED
        where = "on batches from its own dataloader" if sample is not None and sample.batches else "on its objects"
        verdict.reason = f"{REAUDITED} ({where}): {', '.join(rule_ids)} no longer fires (no training step ran)"


def _adds_a_token(tok: Any) -> bool:
    """distinct-pad-token's path that adds <|pad|> and resizes the embeddings (no unk distinct from EOS)."""
    if tok is None or not (tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id):
        return False
    return tok.unk_token is None or tok.unk_token_id == tok.eos_token_id


def split_by_reaudit(fix_ids: list[str], trainer: Any, args: Any) -> tuple[list[str], list[str]]:
    """(re-audited, run on a step): the plan-less fixes are re-audited when there is a trainer (or args) to shadow."""
    by_reaudit = [f for f in fix_ids if fixes.get(f).plan is None and (trainer is not None or args is not None)]
    return by_reaudit, [f for f in fix_ids if f not in by_reaudit]


def merged(stepped: Verification | None, reaudited: list[FixVerdict], what: str) -> Verification:
    """One ranked verification of the step's verdicts and the re-audit's (no step at all when none had a recipe)."""
    if stepped is None:
        stepped = Verification(f"{what} re-audited on the trainer as built", reaudited, step_level=False,
                               step_skipped="no fix offered here runs on a training step")
    else:
        stepped.verdicts = sorted(stepped.verdicts + reaudited, key=lambda v: v.rank)
    if reaudited:
        stepped.notes.append(REAUDIT_NOTE)
    return stepped
