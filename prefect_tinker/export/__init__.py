"""The export engine (no Prefect): a checkpoint exported as a merged Hugging Face model or a PEFT
adapter, through the SDK's own export path (``save_weights_external`` + signed download URLs),
verified by logprobs against the server every time.

Modules: :mod:`.server` (the SDK calls), :mod:`.download` (safe downloads), :mod:`.adapter`
(reading PEFT LoRA adapters), :mod:`.merge` (the exact merge, tied embeddings, shards),
:mod:`.verify` (logprobs against ``compute_logprobs``), :mod:`.output` (local folder or S3).
The Prefect tasks running it are in :mod:`prefect_tinker.tasks.export` (``check-export-output``,
``export-checkpoint``); the ``export`` recipe's flow is :mod:`prefect_tinker.flows.export`.
"""
