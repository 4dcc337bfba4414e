"""Exceptions kiln raises for anything a user can get wrong."""


class KilnError(ValueError):
    """A bad definition, schedule or input; the message names tensor, axis and expectation."""


class KilnTypeError(KilnError, TypeError):
    """A wrong dtype or argument type."""


class KilnAttributeError(KilnError, AttributeError):
    """A name kiln does not have, where another system's name for it is common (``rfactor``)."""


class KilnInternalError(RuntimeError):
    """A bug in kiln itself, never a user mistake (so ``except KilnError`` does not hide
    it); the message starts with "internal compiler error" and should be reported."""
