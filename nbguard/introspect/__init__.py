"""Facts read off the user's objects that both the audit and the fixes need: dtype names, which
parameters are quantised, the embedding matrices and their new-token rows, and the checks that
tell a model from a Trainer from TrainingArguments. Below the auditor and the fixes, so neither
imports the other's internals.
"""
