"""Exceptions nbguard raises on purpose."""


class NbguardError(Exception):
    """Base class of nbguard's own errors."""


class NonFiniteError(NbguardError, FloatingPointError):
    """Raised by the ``stop`` policy in a plain PyTorch loop.

    The last good trainable weights were kept (the bad update was not applied);
    ``event`` is the :class:`nbguard.Event` that stopped training.
    """

    def __init__(self, message: str, event=None):
        super().__init__(message)
        self.event = event
