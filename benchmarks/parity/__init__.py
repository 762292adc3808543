"""The parts of ``benchmarks/cookbook_parity.py`` (tinker-cookbook's training loops and ours, request by
request), one module per job:

- :mod:`.running`: the recording server (``prefect-tinker local serve --record-requests``) and the two
  sides run against it as child processes (the cookbook's program, ``prefect-tinker run``);
- :mod:`.requests`: reading the request logs into the streams that are compared;
- :mod:`.compare`: comparing two sides' streams (exact integers, floats within a relative tolerance,
  losses, final LoRA weights) and the report of a comparison;
- :mod:`.recipe`: what a compared recipe is (:class:`~.recipe.Recipe`) and what every recipe's mapping uses;
- :mod:`.sft`, :mod:`.dpo`, :mod:`.rl`, :mod:`.distill`: per recipe, the cookbook's program, the data both
  sides read and the config mapping (cookbook arguments -> ours), as ``RECIPES`` entries.

The paths and the API key below are shared by all of them.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
API_KEY = "tml-cookbook-parity"
