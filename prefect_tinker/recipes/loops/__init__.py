"""Reference loops: one recipe's whole algorithm in one short file, on the tinker SDK and the same
components the Prefect flows use (no Prefect, no run session).

- :mod:`~prefect_tinker.recipes.loops.sl_loop`: supervised fine-tuning (the ``sft`` flow's steps);
- :mod:`~prefect_tinker.recipes.loops.rl_loop`: RL with verifiable rewards (the ``rl`` flow's
  ``sync`` schedule).

Each sends the same requests as its flow with the equivalent config (``tests/test_reference_loops.py``).
"""
