"""``python -m privtune ...``; also the data-parallel launch ``torchrun --nproc-per-node N -m privtune train ...``
(every process runs the same command; docs/scaling-out.md)."""

import os
import sys


def _data_parallel_command_refused(argv: list[str]) -> str | None:
    """Under torchrun with several processes only ``train`` runs (data-parallel); any other command would run
    once per process (e.g. charge the ledger once per process), so it is refused with this message."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return None
    command = next((a for a in argv if not a.startswith("-")), None)
    if world > 1 and command not in (None, "train"):
        return (f"error: `privtune {command}` does not run data-parallel; under torchrun only `privtune train` "
                f"does (WORLD_SIZE={world}). Run `privtune {command}` without torchrun.")
    return None


refusal = _data_parallel_command_refused(sys.argv[1:])
if refusal is not None:
    print(refusal, file=sys.stderr)
    sys.exit(2)
from privtune.cli import main  # noqa: E402 - after the refusal, which needs no import

status = main()
if "torch.distributed" in sys.modules:  # a torchrun worker: leave the process group it joined
    from privtune.engine.distributed import shutdown

    shutdown()
sys.exit(status)
