# Environment for running offline on the embedded local server (sourced by the scripts).
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_TELEMETRY=0
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export TOKENIZERS_PARALLELISM=false
