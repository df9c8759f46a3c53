"""The prompt dataset: JSONL rows -> (prompt, label), seeded shuffle per epoch, resumable cursor."""
import json
import random

from vime.errors import UserError, require
from vime.paths import require_file


def read_jsonl_rows(path, flag):
    """[(line number, dict)] of a JSONL file; a bad line is a one-line error naming `flag`, file and line."""
    require_file(path, flag)
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _utf8_line(raw, flag, path, lineno)
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


def _utf8_line(raw, flag, path, lineno):
    """The line decoded as UTF-8, or a one-line error naming the line, the byte's column and value."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{flag} {path}: line {lineno}, byte {e.start + 1} (0x{raw[e.start]:02x}) is not UTF-8; "
                        "save the file as UTF-8") from None


def read_prompt_file(path, input_key, label_key, codec=None, apply_chat_template=False, flag="--prompt-data"):
    """[(prompt, label)] of a prompt file, with one-line errors naming `flag`, the file and line.

    Every row needs a label (the reward compares against it: a missing one would score 0
    silently); with `codec` (rollout.tokenizer.TextCodec) every prompt character must be in
    the vocabulary. With `apply_chat_template` the prompt is a list of chat messages
    ({"role", "content"} dicts) the tokenizer's chat template renders."""
    from rollout.tokenizer import check_messages

    rows = []
    for lineno, row in read_jsonl_rows(path, flag):
        where = f"{flag} {path}: line {lineno}"
        require(input_key in row, f"{where} has no key {input_key!r} (set --input-key)")
        prompt = row[input_key]
        if apply_chat_template:
            check_messages(prompt, f"{where}: {input_key!r}")
        else:
            require(isinstance(prompt, str) and prompt,
                    f"{where}: {input_key!r} must be a non-empty string"
                    + (" (chat messages need --apply-chat-template)" if isinstance(prompt, list) else ""))
        require(row.get(label_key) is not None, f"{where} has no label {label_key!r}; add one (or set --label-key)")
        if codec is not None:
            for text in ([m["content"] for m in prompt] if apply_chat_template else [prompt]):
                codec.require_known(text, where)
        rows.append((prompt, row[label_key]))
    return rows


class PromptDataset:
    """Batches of prompts in a seeded order, epoch after epoch; `cursor` makes it resumable."""

    def __init__(self, rows, batch_size, seed, shuffle=True):
        self.rows, self.batch_size, self.seed, self.shuffle = rows, batch_size, seed, shuffle
        self.cursor = 0  # prompts handed out so far, over all epochs
        self._epoch, self._epoch_order = None, None  # the permutation of the current epoch, made once

    def _order(self, epoch):
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _order_of(self, epoch):
        if epoch != self._epoch:
            self._epoch, self._epoch_order = epoch, self._order(epoch)
        return self._epoch_order

    def next_batch(self):
        return self.next_prompts(self.batch_size)

    def next_prompts(self, count):
        """The next `count` prompts of the seeded order (dynamic sampling draws other counts)."""
        out = []
        while len(out) < count:
            epoch, offset = divmod(self.cursor, len(self.rows))
            out.append(self.rows[self._order_of(epoch)[offset]])
            self.cursor += 1
        return out


def check_prompt_files(rollout_cfg, hf_checkpoint, hf):
    """--prompt-data and --eval-prompt-data against the checkpoint `hf` (its ModelConfig): readable rows the
    tokenizer knows, a chat template when --apply-chat-template asks for one, and the longest prompt
    plus --rollout-max-response-len within the model's context."""
    from rollout.tokenizer import codec_or_none

    r = rollout_cfg
    codec = codec_or_none(hf_checkpoint)
    require(codec is not None, f"--hf-checkpoint {hf_checkpoint}: tokenizer.json is missing; RL prompts are text")
    require(not r.apply_chat_template or codec.has_chat_template,
            f"--apply-chat-template: the tokenizer of {hf_checkpoint} has no chat template "
            "(tokenizer_config.json 'chat_template'); drop the flag and give plain-text prompts, or use a chat model")
    prompts = read_prompt_file(r.prompt_data, r.input_key, r.label_key, codec=codec,
                               apply_chat_template=r.apply_chat_template)
    _check_response_fits(prompts, codec, hf, r)
    if r.eval_prompt_data is not None:
        read_prompt_file(r.eval_prompt_data, r.input_key, r.label_key, codec=codec,
                         apply_chat_template=r.apply_chat_template, flag="--eval-prompt-data")


def _check_response_fits(prompts, codec, hf, rollout_cfg):
    """The longest prompt plus --rollout-max-response-len fits the model's context (else responses
    would be cut at the context silently, shorter than the flag says)."""
    chat = rollout_cfg.apply_chat_template
    longest = max(len(codec.prompt_ids(prompt, hf.bos_token_id, chat)) for prompt, _ in prompts)
    total = longest + rollout_cfg.rollout_max_response_len
    require(total <= hf.max_position_embeddings,
            f"--rollout-max-response-len {rollout_cfg.rollout_max_response_len}: with the longest prompt "
            f"({longest} tokens) that is {total} positions, beyond the model's context of "
            f"{hf.max_position_embeddings}; use --rollout-max-response-len "
            f"{max(hf.max_position_embeddings - longest, 1)} or less")
