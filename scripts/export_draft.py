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

from trainer.drafts import DRAFT_STATE_FILE, read_draft_state, saved_draft_state_file  # noqa: E402
from vime.checkpointing import resolve_load  # noqa: E402
from vime.errors import exit_on_user_error, require  # noqa: E402
from vime.paths import require_not_an_input  # noqa: E402
from vime.models.draft_kinds import EXTERNAL_KINDS, external_kind  # noqa: E402


@exit_on_user_error
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="the run's --save directory")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    require_not_an_input(args.out, "--out", [(args.load, "--load")])
    step, iteration, _ = resolve_load(args.load, otherwise="export another run's --save directory")
    file = saved_draft_state_file(os.path.join(iteration, "model"))
    require(file is not None, f"--load {args.load}: step {step} holds no external draft ({DRAFT_STATE_FILE}); "
            "the run was not trained with --enable-draft-training")
    state = read_draft_state(file)
    kind = external_kind(state["kind"])
    require(kind is not None, f"--load {args.load}: step {step} holds a {state['kind']} draft, which has no "
            f"directory format of its own (exported kinds: {', '.join(k.name for k in EXTERNAL_KINDS)})")
    kind.save(args.out, state["config"], state["draft"])  # its tensors checked against its config first
    print(f"saved {args.out} (the {kind.name} draft at step {step})")


if __name__ == "__main__":
    main()
