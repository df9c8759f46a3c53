"""--save-keep: the newest N complete checkpoints stay; the one `latest` names and a .tmp being
written are never removed; the loop state is JSON."""
import json
import os

from vime import checkpointing


def writer(path):
    os.makedirs(path)
    open(os.path.join(path, "w.bin"), "wb").write(b"x")


def iters(root):
    return sorted(x for x in os.listdir(root) if x.startswith("iter_"))


def test_save_keep_leaves_the_newest_n_and_never_a_tmp_being_written(tmp_path):
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "iter_0000009.tmp"))  # another save in flight
    for step in range(1, 6):
        checkpointing.save(root, step, writer, {"step": step, "data_cursor": 4 * step}, keep=2)
    assert iters(root) == ["iter_0000004", "iter_0000005", "iter_0000009.tmp"]
    assert checkpointing.latest(root)[0] == 5
    state_file = os.path.join(root, "iter_0000005", "loop_state.json")
    assert json.load(open(state_file)) == {"step": 5, "data_cursor": 20}  # JSON, not a pickle


def test_save_keep_never_removes_the_checkpoint_latest_names(tmp_path):
    root = str(tmp_path)
    for step in (2, 7, 8):  # a run resumed from step 2 leaves the later checkpoints of its first try
        checkpointing.save(root, step, writer, {"step": step}, keep=None)
    checkpointing.save(root, 3, writer, {"step": 3}, keep=1)
    assert checkpointing.latest(root)[0] == 3
    assert "iter_0000003" in iters(root) and "iter_0000008" in iters(root)
    assert "iter_0000002" not in iters(root) and "iter_0000007" not in iters(root)


def test_without_save_keep_every_checkpoint_stays(tmp_path):
    for step in range(1, 4):
        checkpointing.save(str(tmp_path), step, writer, {"step": step})
    assert iters(tmp_path) == ["iter_0000001", "iter_0000002", "iter_0000003"]
