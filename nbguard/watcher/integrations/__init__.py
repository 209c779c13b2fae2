"""How the watch finds step boundaries: plain PyTorch loops and HF/TRL trainers."""
