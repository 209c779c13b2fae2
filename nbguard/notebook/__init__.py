"""The notebook face of nbguard: magics, widgets, display fallbacks, the lab-extension comm.

Everything here is a thin layer over the core API (``nbguard.audit``, ``nbguard.watch``,
``nbguard.fixes``, ``nbguard.explain``); nothing in the core imports this package.
"""
