"""The privacy unit: user-level DP by Poisson sampling over units (a person, a conversation, a document).

Example-level DP protects one row.  When a person owns many rows, privtune can protect the person instead:
the neighbouring relation becomes "adding or removing all rows of one unit" (docs/privacy-unit.md).  The
mechanism, in the one DP step of the engine (no second step):

1. **Sampling over units.**  Each of the N_u units joins a logical batch independently with probability q
   (:func:`privtune.engine.sampling.poisson_mask` over the units: the same exact integer threshold, so the
   inclusion probability is ≤ q exactly).  q = expected units per batch / N_u.
2. **At most k rows per sampled unit.**  A sampled unit with more than ``max_rows_per_unit`` (k, a public
   cap) rows contributes a fresh uniformly random subset of k of them, drawn from the run's generator; rows
   beyond the subset are not used in that step.
3. **One vector of norm ≤ C per unit.**  Each used row's per-example gradient is clipped to C (the engine's
   clip factors) and weighted by 1/m_u, m_u the number of rows of its unit used in this step
   (:meth:`UnitIndex.row_weights`).  The unit's contribution is the mean of ≤ k clipped gradients, whose norm
   is ≤ C by the triangle inequality; adding or removing a unit therefore changes the clipped sum by at most
   C, and the Poisson-subsampled Gaussian accountant applies over units unchanged (noise σC, q, T).

A unit with exactly one row gets weight 1: with one row per unit the batches, weights and released gradient
are those of example-level DP-SGD with the same seed, bit for bit.

How many rows a unit has is private: :class:`UnitIndex` keeps the counts internal and nothing here returns
them; N_u (the number of units) is public by the user's declaration, like N is at example level.
"""

from __future__ import annotations

import difflib
import math
import os
from pathlib import Path
from typing import Any, Sequence

import torch

from privtune._validation import check_int, check_sample_rate
from privtune.engine.sampling import make_generator, poisson_mask
from privtune.errors import DataError, InvalidParameterError

__all__ = ["DEFAULT_MAX_ROWS_PER_UNIT", "UnitIndex", "UnitSampler", "unit_index"]

#: The default public cap k on the rows one unit contributes to a step: it bounds a step's work per unit (a
#: unit with thousands of rows costs at most k rows' forward and backward passes) while averaging enough rows
#: to lower the variance of the unit's contribution (docs/privacy-unit.md, "The cap k").
DEFAULT_MAX_ROWS_PER_UNIT = 8


class UnitIndex:
    """Which privacy unit each row belongs to.

    Args:
        keys: one hashable key per row (a user id, a conversation id, ...), in row order.
        name: what a unit is, for the privacy statement (e.g. the column name ``"user_id"``).

    Units are numbered 0 … N_u − 1 in order of first appearance.  ``num_units`` (N_u) is public by the
    user's declaration; the number of rows per unit is private and not exposed.
    """

    def __init__(self, keys: Sequence[Any], name: str = "unit"):
        ids: dict[Any, int] = {}
        unit_of_row = []
        for i, key in enumerate(keys):
            key = _checked_key(key, i, name)
            try:
                unit_of_row.append(ids.setdefault(key, len(ids)))
            except TypeError:
                raise InvalidParameterError(
                    f"The privacy unit of row {i + 1} must be hashable (a string or a number). Got a "
                    f"{type(key).__name__}. Return an id such as a user id."
                ) from None
        if not unit_of_row:
            raise DataError("The training data is empty. Pass at least one row with a privacy unit.")
        self.name = str(name)
        self.column: str | None = None  # the data column the keys were read from (load_units), if any
        #: (N,) unit number of every row
        self.unit_of_row = torch.tensor(unit_of_row, dtype=torch.long)
        self.num_units = len(ids)
        self._counts = torch.bincount(self.unit_of_row, minlength=self.num_units)  # PRIVATE: never released

    @property
    def num_rows(self) -> int:
        return int(self.unit_of_row.numel())

    @property
    def one_row_per_unit(self) -> bool:
        """True when every unit has one row (then user-level is example-level)."""
        return self.num_units == self.num_rows

    def row_weights(self, idx: torch.Tensor) -> torch.Tensor:
        """(len(idx),) float64 weights 1/m_u of the rows ``idx`` of one logical batch, m_u the number of rows
        of row i's unit among ``idx``.  A unit's weighted clipped gradients sum to their mean (norm ≤ C)."""
        if idx.numel() == self.num_rows:  # every row (a full batch within the cap): m_u = c_u, the same each step
            if getattr(self, "_all_weights", None) is None:
                self._all_weights = self.mean_weights()
            return self._all_weights[idx]
        units = self.unit_of_row[idx]
        used = torch.bincount(units, minlength=self.num_units)
        return 1.0 / used[units].to(torch.float64)

    def mean_weights(self) -> torch.Tensor:
        """(N,) float64 weights 1/c_u of every row, c_u all the rows of its unit: a statistic summed with these
        weights adds each unit's *mean* of its rows' values, so a unit moves a sum of per-row values in [−b, b] by
        at most b however many rows it has (the charged scores and the private feature centre of tuning)."""
        return 1.0 / self._counts[self.unit_of_row].to(torch.float64)

    def subset(self, rows: torch.Tensor) -> "UnitIndex":
        """The index of the rows ``rows`` (a split of the data keeps its rows' units)."""
        keys = self.unit_of_row[torch.as_tensor(rows, dtype=torch.long)].tolist()
        return UnitIndex(keys, name=self.name)


def _checked_key(key: Any, row: int, name: str) -> Any:
    """A row's unit key, with surrounding spaces removed from a string (``" u1"`` and ``"u1"`` are one unit);
    a missing value (empty, nan, null, None: the spellings a missing label has) is an error naming the row."""
    from privtune.data.labels import MISSING_LABEL_SPELLINGS

    if isinstance(key, str):
        key = key.strip()
    missing = (key is None or (isinstance(key, float) and math.isnan(key))
               or (isinstance(key, str) and (not key or key.lower() in MISSING_LABEL_SPELLINGS)))
    if missing:
        raise DataError(f"Row {row + 1} has no privacy unit ({name!r} is empty, nan, null or None). Fill it in or "
                        "remove the row: a row without its owner cannot be protected with the owner's other rows.")
    return key


def unit_index(privacy_unit: Any, num_rows: int, name: str | None = None) -> UnitIndex:
    """A :class:`UnitIndex` from what a user passes as ``privacy_unit``.

    Args:
        privacy_unit: a :class:`UnitIndex`; a sequence of one key per row; or a callable ``f(i) -> key``
            called with every row index i in 0 … num_rows − 1.
        num_rows: the number of training rows N.
        name: what a unit is (for the statement); default the UnitIndex's own, else ``"unit"``.
    """
    if isinstance(privacy_unit, UnitIndex):
        index = privacy_unit
    elif callable(privacy_unit):
        index = UnitIndex([privacy_unit(i) for i in range(int(num_rows))], name=name or "unit")
    elif isinstance(privacy_unit, (str, bytes)) or not hasattr(privacy_unit, "__len__"):
        raise InvalidParameterError(
            f"`privacy_unit` must be one key per row, a callable f(row_index) -> key, or a UnitIndex. Got "
            f"{type(privacy_unit).__name__}. (A column name is resolved when the data is loaded: CLI "
            "--privacy-unit COLUMN.)"
        )
    else:
        index = UnitIndex(list(privacy_unit), name=name or "unit")
    if index.num_rows != int(num_rows):
        raise InvalidParameterError(
            f"`privacy_unit` must give one unit per training row: got {index.num_rows} for {int(num_rows)} rows."
        )
    if name:
        index.name = str(name)
    return index


class UnitSampler:
    """Poisson sampling over units with at most k rows per sampled unit (module docstring).

    Args:
        units: the :class:`UnitIndex` of the training rows.
        sample_rate: q ∈ (0, 1], the inclusion probability of each unit (q = 1: every unit every step).
        max_rows_per_unit: k ≥ 1, the public cap on a unit's rows used in one step.
        seed: integer seed, or None to seed from the OS.  The unit mask uses a generator seeded like
            :class:`~privtune.engine.sampling.PoissonSampler`'s (so with one row per unit the batches are
            the example-level ones); the choice of k rows uses a second generator (seed + 2).

    :meth:`sample` returns sorted ``torch.long`` row indices, like the example-level samplers.
    """

    sampling = "poisson_units"

    def __init__(self, units: UnitIndex, sample_rate: float, max_rows_per_unit: int = DEFAULT_MAX_ROWS_PER_UNIT,
                 seed: int | None = None):
        self.units = units
        self.sample_rate = check_sample_rate(sample_rate)
        self.max_rows_per_unit = check_max_rows_per_unit(max_rows_per_unit)
        self.seed = None if seed is None else check_int(seed, "seed", low=0, high=2**62,
                                                         fix="Pass a non-negative integer or None (OS entropy).")
        self._g = make_generator(self.seed)
        self._g_rows = make_generator(self.seed, offset=2)
        # rows grouped by unit, for the choice of k rows in over-cap units
        self._rows_by_unit = torch.argsort(units.unit_of_row, stable=True)
        self._first_row = torch.cumsum(units._counts, 0) - units._counts
        # no unit above the cap: a step's rows are all rows of its units (no choice, no sort: nonzero is sorted)
        self._all_within_cap = int(units._counts.max()) <= self.max_rows_per_unit if units.num_units else True

    @property
    def expected_batch_size(self) -> float:
        """q·N_u, the expected number of units per step: the public normaliser of the privatised sum."""
        return self.sample_rate * self.units.num_units

    def sample(self) -> torch.Tensor:
        """Draw one logical batch: the rows used from each sampled unit (≤ k per unit), sorted."""
        if self.sample_rate >= 1.0:  # every unit, nothing drawn (as example-level full batch)
            if self._all_within_cap:  # every row, every step
                return torch.arange(self.units.num_rows)
            unit_mask = torch.ones(self.units.num_units, dtype=torch.bool)
        else:
            unit_mask = poisson_mask(self.units.num_units, self.sample_rate, self._g)
        return self.rows_of(unit_mask)

    def rows_of(self, unit_mask: torch.Tensor) -> torch.Tensor:
        """Sorted rows used from the units of ``unit_mask`` (N_u,) bool: all rows of a unit with ≤ k rows,
        a uniformly random k of them otherwise (from this sampler's row generator)."""
        if self._all_within_cap:
            return unit_mask[self.units.unit_of_row].nonzero().squeeze(1)
        k = self.max_rows_per_unit
        counts = self.units._counts
        big = unit_mask & (counts > k)
        keep = unit_mask[self.units.unit_of_row] & ~big[self.units.unit_of_row]
        rows = keep.nonzero().squeeze(1)
        if bool(big.any()):
            rows = torch.cat([rows, self._chosen_rows(big.nonzero().squeeze(1), k)])
        return torch.sort(rows).values

    def _chosen_rows(self, big_units: torch.Tensor, k: int) -> torch.Tensor:
        """k uniformly random rows of each unit of ``big_units`` (all have more than k rows)."""
        counts = self.units._counts[big_units]
        starts = self._first_row[big_units]
        # positions of every row of these units in _rows_by_unit, unit by unit
        owner = torch.repeat_interleave(torch.arange(big_units.numel()), counts)
        offset = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
        rows = self._rows_by_unit[starts[owner] + offset]
        # a random key per row; within each unit the k smallest keys win (a uniform k-subset)
        keys = torch.rand(rows.numel(), generator=self._g_rows, dtype=torch.float64)
        order = torch.argsort(keys)
        order = order[torch.argsort(owner[order], stable=True)]  # by unit, then by key
        rank = offset  # after the sort, position within the unit is again 0 … c_u − 1
        return rows[order][rank < k]

    def state_dict(self) -> dict:
        return {"sampling": self.sampling, "seed": self.seed, "generator_state": self._g.get_state(),
                "row_generator_state": self._g_rows.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or state.get("sampling") != self.sampling:
            raise InvalidParameterError(
                f"`state` must come from UnitSampler.state_dict(). Got {state!r:.80}. Pass the saved sampler state."
            )
        self.seed = state.get("seed")
        self._g.set_state(state["generator_state"])
        self._g_rows.set_state(state["row_generator_state"])


def unit_description(units: UnitIndex, max_rows_per_unit: int) -> dict:
    """What a run publishes about its privacy unit: the unit's name, the cap k and N_u (public by
    declaration, like N).  No row count of any unit."""
    return {"unit": units.name, "column": units.column, "max_rows_per_unit": int(max_rows_per_unit),
            "num_units": units.num_units}


def check_max_rows_per_unit(k: Any) -> int:
    """k, the public cap on one unit's rows per step: an integer ≥ 1."""
    return check_int(k, "max_rows_per_unit", low=1,
                     fix=f"Pass the most rows one unit may contribute to a step, e.g. {DEFAULT_MAX_ROWS_PER_UNIT}.")


def check_unit_delta(delta: float, num_units: int, unit: str) -> None:
    """Refuse δ ≥ 1/N_u: at user level δ must be below one over the number of units (a mechanism that
    publishes one whole unit's rows with probability δ would otherwise be (0, δ)-DP)."""
    if float(delta) >= 1.0 / int(num_units):
        raise InvalidParameterError(
            f"δ = {float(delta):g} is not below 1/N_u = 1/{int(num_units)} (the number of {unit} units): at "
            f"user level δ must be smaller than one over the number of units. Pass --delta below "
            f"{1.0 / int(num_units):.3g}, e.g. {min(1e-5, 0.1 / int(num_units)):.3g}."
        )



def checked_units(privacy_unit: Any, num_rows: int, max_rows_per_unit: Any, sampling: str) -> UnitIndex | None:
    """``fit``'s privacy-unit options checked: the :class:`UnitIndex` (None for example level) after refusing a
    sampling scheme other than Poisson or full batch (shuffled fixed-size batches of units have no accounting
    here), a cap k that is not an integer ≥ 1 and a data-parallel run."""
    if privacy_unit is None:
        return None
    check_max_rows_per_unit(max_rows_per_unit)
    from privtune.engine.distributed import data_parallel_world_size

    if data_parallel_world_size() > 1:  # refused here, before a ledger reservation (the loop would refuse later)
        raise InvalidParameterError(
            f"A privacy unit needs the whole batch in one process (a unit's rows are weighted together); this run has "
            f"{data_parallel_world_size()} data-parallel processes. Run user-level training in one process (without "
            "torchrun / a torch.distributed process group)."
        )
    if sampling not in ("poisson", "full_batch"):
        raise InvalidParameterError(
            f"A privacy unit is sampled by Poisson sampling over units; sampling={sampling!r} is not supported with "
            "it. Use sampling='poisson' (the default, CLI --sampling poisson)."
        )
    return unit_index(privacy_unit, num_rows)


#: the sidecar table of an image dataset that names each image's privacy unit (docs/privacy-unit.md, "Images"):
#: ``ROOT/units.<ext>`` in an image folder (a ``file`` column: the image's path under ROOT), or
#: ``<IDX images file>.units.<ext>`` next to IDX images (one row per image, in the file's order)
UNITS_SIDECAR = "units"
UNITS_SIDECAR_SUFFIXES = (".tsv", ".csv", ".jsonl")


def load_units(data: Any, privacy_unit: Any, num_rows: int, dataset: Any = None) -> UnitIndex:
    """The :class:`UnitIndex` of a loaded training set: ``privacy_unit`` a column name of the text table
    ``data`` (.tsv/.csv/.jsonl file or a ``datasets.Dataset``) or of an image dataset's sidecar table
    (:data:`UNITS_SIDECAR`; ``dataset`` the loaded :class:`privtune.data.ImageDataset`, whose images it must
    cover), or anything :func:`unit_index` takes.  Nothing here depends on the task: any loaded dataset whose
    rows have a fixed order can name its units with one key per row (Python) or a table column.

    Raises one clear error for a column that is not there or a file type without columns; a message names
    the column and row numbers, never a unit's value."""
    if not isinstance(privacy_unit, str):
        return unit_index(privacy_unit, num_rows)
    column = privacy_unit
    sidecar = _image_sidecar(data) if getattr(dataset, "kind", None) == "image" else None
    if sidecar is not None:
        columns, keys, where = _sidecar_keys(sidecar, data, dataset, column)
    else:
        columns, keys, where = _column_keys(data, column)
    if column not in columns:
        close = difflib.get_close_matches(column, columns, n=1)
        raise DataError(
            f"{where}: privacy-unit column {column!r} (from `--privacy-unit`) not found; the columns are {columns}."
            + (f" Did you mean {close[0]!r}?" if close else " Pass the column that names the person (or document).")
        )
    index = unit_index(keys, num_rows, name=column)
    index.column = column
    return index


def _image_sidecar(data: Any) -> Path | None:
    """The sidecar table of the image dataset at ``data`` (a folder, or an IDX images file), if there is one."""
    if not isinstance(data, (str, os.PathLike)):
        return None
    path = Path(data).expanduser()
    base = path / UNITS_SIDECAR if path.is_dir() else path.with_name(f"{path.name}.{UNITS_SIDECAR}")
    found = [base.with_name(base.name + s) for s in UNITS_SIDECAR_SUFFIXES if base.with_name(base.name + s).is_file()]
    if len(found) > 1:
        raise DataError(f"{str(path)!r} has {len(found)} privacy-unit tables ({', '.join(f.name for f in found)}); "
                        "keep one.")
    return found[0] if found else None


def _sidecar_keys(sidecar: Path, data: Any, dataset: Any, column: str) -> tuple[list, list, str]:
    """``(columns, one key per image of dataset, where)`` from an image dataset's sidecar table: for an image
    folder its ``file`` column (the image's path under the folder) matches each image, for IDX images its rows
    are the images in order.  An image the table does not list (or a table row for no image) is an error
    that counts them, naming no file and no unit."""
    from privtune.data.datasets import TEXT_SUFFIXES, read_table

    columns, rows = read_table(sidecar, TEXT_SUFFIXES[sidecar.suffix.lower()], single_column_ok=True)
    where = str(sidecar)
    if column not in columns:
        return list(columns), [], where
    root = Path(data).expanduser()
    if root.is_dir():
        if "file" not in columns:
            raise DataError(f"{where}: the privacy-unit table of an image folder needs a `file` column (each image's "
                            "path under the folder, e.g. cat/001.png) next to the unit column.")
        by_file = {str(Path(str(r.get("file", "")).strip())): r.get(column) for r in rows}
        files = [Path(img).resolve().relative_to(root.resolve()).as_posix() for img in dataset.images]
        missing = sum(f not in by_file for f in files)
        if missing or len(by_file) != len(files):
            raise DataError(f"{where}: {missing} image(s) of the folder are not listed and {len(by_file) - len(files) + missing} "
                            "row(s) name no image of it. List every image once, by its path under the folder.")
        return list(columns), [by_file[f] for f in files], where
    if len(rows) != len(dataset):
        raise DataError(f"{where}: {len(rows)} row(s) for {len(dataset)} image(s). Give one row per image of the IDX "
                        "file, in the file's order.")
    return list(columns), [r.get(column) for r in rows], where


def _column_keys(data: Any, column: str) -> tuple[list, list, str]:
    """``(columns, keys of column (empty when absent), how errors name the data)`` of a text table ``data``."""
    if isinstance(data, (str, os.PathLike)):
        from privtune.data.datasets import TEXT_SUFFIXES, read_table

        path = Path(data).expanduser()
        fmt = TEXT_SUFFIXES.get(path.suffix.lower())
        if fmt is None or path.is_dir():
            raise DataError(
                f"--privacy-unit {column!r}: {str(path)!r} has no columns; a privacy-unit column is read from a text "
                "table (.tsv/.csv/.jsonl) or, for images, from a table `units.tsv` in the image folder (columns `file` "
                "and the unit) or `<IDX images file>.units.tsv` (one row per image). In Python pass "
                "privacy_unit=[one key per row]."
            )
        columns, rows = read_table(path, fmt)
        return list(columns), [row.get(column) for row in rows], str(path)
    if hasattr(data, "column_names"):  # a datasets.Dataset
        columns = list(data.column_names)
        return columns, (list(data[column]) if column in columns else []), "the dataset"
    raise InvalidParameterError(
        f"`privacy_unit` {column!r} names a column, but the data is a {type(data).__name__} without columns. Pass "
        "one key per row (privacy_unit=[...]) or a callable f(row_index) -> key."
    )


def check_units_disjoint(train_data: Any, split: Any, column: str, what: str) -> bool:
    """Refuse a split ``split`` (a public or reported split: a table, an image folder or IDX file with its
    privacy-unit table, or a ``datasets.Dataset``) that holds a row of a
    privacy unit that owns rows of the private ``train_data``: at user level a split outside the private data
    must be disjoint from it by unit, not only by row.  Checked when ``split`` has the unit ``column``; returns
    False when it has not (then only its rows can be checked, and its disjointness by unit is the user's
    declaration).  The message names no unit."""
    if split is None or not isinstance(column, str):
        return False
    try:
        columns, keys = _split_unit_keys(split, column)
    except (DataError, InvalidParameterError):  # no columns (an in-memory dataset): not checkable
        return False
    if column not in columns:
        return False
    _, private = _split_unit_keys(train_data, column)
    private_ids = {_plain_key(k) for k in private}
    if any(_plain_key(k) in private_ids for k in keys if k is not None):
        raise DataError(
            f"`{what}` shares privacy units with the private training data: at least one {column!r} value owns rows "
            f"of both. A split outside the private data must hold no row of a private {column}; remove those rows "
            "from it (or from the training data). Nothing was charged.")
    return True


def _split_unit_keys(data: Any, column: str) -> tuple[list, list]:
    """``(columns, the values of column)`` of a split: an image folder's or IDX file's privacy-unit table (every
    row of the table: the conservative reading), else the split's own table (:func:`_column_keys`)."""
    from privtune.data.datasets import TEXT_SUFFIXES, read_table

    is_table = isinstance(data, (str, os.PathLike)) and Path(data).suffix.lower() in TEXT_SUFFIXES
    sidecar = None if is_table else _image_sidecar(data)
    if sidecar is None:
        columns, keys, _ = _column_keys(data, column)
        return columns, keys

    columns, rows = read_table(sidecar, TEXT_SUFFIXES[sidecar.suffix.lower()], single_column_ok=True)
    return list(columns), [r.get(column) for r in rows] if column in columns else []


def _plain_key(key: Any) -> Any:
    """A unit key compared across files: its text without surrounding spaces (a TSV's "7" and a JSONL's 7 are
    one unit: the conservative reading for a disjointness check)."""
    return str(key).strip()
