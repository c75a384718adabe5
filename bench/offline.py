"""Environment every bench script sets before torch/transformers load: offline Hugging Face (the machine has
no model hub; the bundled MiniLM is read from disk) and no tokenizer thread pool (it would compete with the
DP step for the machine's cores).  Import it first: ``import offline  # noqa: F401`` (bench/ is on sys.path
as the running script's folder)."""

import os

for _name, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
    os.environ.setdefault(_name, _value)
