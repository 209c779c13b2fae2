"""Naming where a bad step went wrong: the replay that finds the first non-finite module, the rows that
broke it, and the events that say so."""
