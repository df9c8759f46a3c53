#!/usr/bin/env bash
# HF -> torch_dist with the MTP layers kept. Usage:
#   scripts/convert_hf_to_torch_dist.sh HF_DIR SAVE_DIR [MTP_LAYERS] [extra flags...]
# MTP_LAYERS defaults to config.json's num_nextn_predict_layers.
set -euo pipefail
HF_DIR=${1:?usage: $0 HF_DIR SAVE_DIR [MTP_LAYERS] [flags...]}
SAVE_DIR=${2:?usage: $0 HF_DIR SAVE_DIR [MTP_LAYERS] [flags...]}
shift 2
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then MTP=$1; shift; else
  MTP=$(python -c "import json,sys; print(json.load(open(sys.argv[1]+'/config.json')).get('num_nextn_predict_layers',0) or 0)" "$HF_DIR")
fi
cd "$(dirname "$0")/.."
exec python -m checkpoint_convert.hf_to_torch_dist --hf-checkpoint "$HF_DIR" --save "$SAVE_DIR" \
  --mtp-num-layers "$MTP" "$@"
