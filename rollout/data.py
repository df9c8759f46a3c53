"""The prompt dataset: JSONL rows -> (prompt, label), seeded shuffle per epoch, resumable cursor."""
import json
import os
import random

from vime.errors import UserError, require


def read_jsonl_rows(path, flag):
    """[(line number, dict)] of a JSONL file; a bad line is a one-line error naming `flag`, file and line."""
    require(path and os.path.isfile(path), f"{flag} {path}: no such file")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise UserError(f"{flag} {path}: line {lineno} is not valid JSON ({e.msg})") from None
            require(isinstance(row, dict), f"{flag} {path}: line {lineno} must be a JSON object")
            rows.append((lineno, row))
    require(rows, f"{flag} {path}: the file holds no prompts")
    return rows


def read_prompt_file(path, input_key, label_key):
    """[(prompt, label)] of the RL prompt file, with one-line errors naming the file and line."""
    rows = []
    for lineno, row in read_jsonl_rows(path, "--prompt-data"):
        require(input_key in row, f"--prompt-data {path}: line {lineno} has no key {input_key!r} (set --input-key)")
        require(isinstance(row[input_key], str) and row[input_key],
                f"--prompt-data {path}: line {lineno}: {input_key!r} must be a non-empty string")
        rows.append((row[input_key], row.get(label_key)))
    return rows


class PromptDataset:
    """Batches of prompts in a seeded order, epoch after epoch; `cursor` makes it resumable."""

    def __init__(self, rows, batch_size, seed, shuffle=True):
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.cursor = 0  # prompts handed out so far, over all epochs

    def _order(self, epoch):
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def next_batch(self):
        out = []
        while len(out) < self.batch_size:
            epoch, offset = divmod(self.cursor, len(self.rows))
            out.append(self.rows[self._order(epoch)[offset]])
            self.cursor += 1
        return out
