#!/usr/bin/env python
"""Export the external draft an online run trained (--enable-draft-training) as a directory vLLM serves.

    python scripts/export_draft.py --load SAVE_DIR --out DIR

SAVE_DIR is a run's --save directory (the checkpoint `--load SAVE_DIR` would resume from) or one
iteration of it (`SAVE_DIR/iter_0000002`: the draft of that step), verified as `--load` verifies it.
The draft is written in its kind's format (EAGLE-3: `LlamaForCausalLMEagle3`; DFlash:
`DFlashDraftModel`), so DIR loads, unchanged, with
`vllm.LLM(model=TARGET, speculative_config={"method": KIND, "model": DIR, ...})`, TARGET being the
policy of the same checkpoint exported with checkpoint_convert.torch_dist_to_hf.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from trainer.drafts import DRAFT_STATE_FILE, saved_draft_state_file  # noqa: E402
from vime.checkpointing import resolve_load  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.models import dflash, dspark, eagle3  # noqa: E402

# a draft kind -> the writer of its directory format (vime/models/<kind>.py)
DRAFT_WRITERS = {"eagle3": eagle3.save_draft, "dflash": dflash.save_draft, "dspark": dspark.save_draft}


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="the run's --save directory")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    step, iteration, _ = resolve_load(args.load)
    file = saved_draft_state_file(os.path.join(iteration, "model"))
    require(file is not None, f"--load {args.load}: step {step} holds no external draft ({DRAFT_STATE_FILE}); "
            "the run was not trained with --enable-draft-training")
    state = torch.load(file, map_location="cpu", weights_only=False)
    kind = state.get("kind", "eagle3")  # the legacy file held an EAGLE-3 draft
    require(kind in DRAFT_WRITERS, f"--load {args.load}: step {step} holds a {kind} draft, which has no directory "
            f"format of its own (exported kinds: {', '.join(DRAFT_WRITERS)})")
    DRAFT_WRITERS[kind](args.out, state["config"], state["draft"])
    print(f"saved {args.out} (the {kind} draft at step {step})")


if __name__ == "__main__":
    main()
