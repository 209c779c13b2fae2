"""One training step, as the auditor's probe, the watch's replay and the verifier run it.

Written once, below all three: micro-batch capture (inputs, RNG, autocast, the gradients at the
outputs), eager unwrapping of ``torch.compile``, forward kwargs and the synthetic batch, and what a
Trainer hands a step (model, args, optimizer, the autocast its accelerator enters).
"""
