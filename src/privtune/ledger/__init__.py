"""The per-dataset privacy budget ledger (SQLite by default, PostgreSQL for teams).

::

    from privtune.ledger import Ledger, dataset_fingerprint
    from privtune.accounting.events import DPSGDEvent

    ledger = Ledger()                                   # $PRIVTUNE_LEDGER or ~/.privtune/ledger.db
    fp = dataset_fingerprint("train.jsonl")             # content SHA-256: private, never publish it
    st = ledger.init_dataset(fp, epsilon=8.0, delta=1e-5, name="support-tickets")
    st.dataset_id                                       # random id ("ds-…"): what run directories show
    with ledger.spend(fp, [DPSGDEvent(1.1, 0.01, 1000)], command="my_script.py") as reservation:
        ...                                             # read data and train here
    print(ledger.status(fp).remaining_epsilon)

See ``docs/ledger.md``.
"""

# Public names for helpers other packages need (training.py, hpo/tune.py import them from the private
# modules until they are restructured).
from privtune.ledger._backend import default_ledger_url, mask_url, url_without_password
from privtune.ledger._compose import composed_epsilon, group_events
from privtune.ledger._key import demo_key_path
from privtune.ledger.fingerprint import dataset_fingerprint, dataset_identity, is_fingerprint
from privtune.ledger.ledger import (
    ACCOUNTANTS,
    BudgetStatus,
    Entry,
    Ledger,
    Record,
    Reservation,
    VerifyReport,
    check_ledger_argument,
    open_ledger,
)

__all__ = [
    "Ledger",
    "Reservation",
    "BudgetStatus",
    "Entry",
    "Record",
    "VerifyReport",
    "ACCOUNTANTS",
    "dataset_fingerprint",
    "dataset_identity",
    "is_fingerprint",
    "default_ledger_url",
    "group_events",
    "composed_epsilon",
    "mask_url",
    "url_without_password",
    "demo_key_path",
    "check_ledger_argument",
    "open_ledger",
]
