"""Exceptions kiln raises for anything a user can get wrong."""


class KilnError(ValueError):
    """A bad definition, schedule or input; the message names tensor, axis and expectation."""


class KilnTypeError(KilnError, TypeError):
    """A wrong dtype or argument type."""
