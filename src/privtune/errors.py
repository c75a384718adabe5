"""Exceptions raised by privtune.

Every error a user can cause is a subclass of :class:`PrivtuneError`, which is a
``ValueError``, so ``except ValueError`` keeps working.  Messages name the argument,
the value that was given and what to do instead; the command-line interface prints
the message on one line and exits with status 2.
"""

from __future__ import annotations


class PrivtuneError(ValueError):
    """Base class of all errors caused by user input or by a budget that does not fit."""


class InvalidParameterError(PrivtuneError, TypeError):
    """An argument has a wrong type or a value outside its allowed range."""


class InfeasibleBudgetError(PrivtuneError):
    """The requested privacy target cannot be met (e.g. no σ below the ceiling reaches it,
    or events already spent exceed the total before the final run)."""


class BudgetExceededError(PrivtuneError):
    """A spend does not fit into a dataset's remaining privacy budget."""


class LedgerError(PrivtuneError):
    """The budget ledger is missing, unreadable, corrupted or inconsistent."""


class UnknownDatasetError(LedgerError):
    """A dataset has no budget in the ledger yet."""


class CertificateError(PrivtuneError):
    """A privacy certificate is malformed or its ε does not match its events."""


class DataError(PrivtuneError):
    """Training or evaluation data is missing, empty, unreadable or malformed."""


class ModelError(PrivtuneError):
    """A model path or architecture cannot be used as asked."""


class UnsupportedModuleError(ModelError):
    """A trainable module cannot be trained privately as configured (e.g. BatchNorm in train mode)."""


class PrivtuneWarning(UserWarning):
    """Something works but is unsafe or surprising; the command line prints it as one ``warning:`` line.
    ``warnings.simplefilter("error", PrivtuneWarning)`` turns privtune's warnings into exceptions (a warning issued
    before the ledger reservation then stops the run with nothing charged)."""


class UnlikelyToLearnWarning(PrivtuneWarning):
    """Issued before the ledger reservation: the mode was measured not to learn at this n·ε
    (:mod:`privtune.finetune.usefulness`)."""


class OneClassModelWarning(PrivtuneWarning):
    """Issued after a run: the released model predicts nearly one class on a split that is not private."""
