"""Tokenizers: the tiny task's character vocabulary and the chat model's byte-level BPE (both saved
as files AutoTokenizer loads), and TextCodec, the rollout's one way from prompt rows to token ids.

A checkpoint's tokenizer is read with `transformers.AutoTokenizer`, so prompts are tokenized as the
model's users tokenize them; `--apply-chat-template` renders `messages` rows with the tokenizer's
own chat template (`apply_chat_template(..., add_generation_prompt=True)`).
"""
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from rollout.task import CHARS, SPECIALS


def build_tokenizer():
    vocab = {tok: i for i, tok in enumerate(list(SPECIALS) + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIALS))
    return tok


def save_tokenizer(tok, path):
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": "<pad>", "bos_token": "<bos>",
              "eos_token": "<eos>", "model_max_length": 512, "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


# The chat model's special tokens (ChatML, as Qwen's): pad first so id 0 pads, as in the tiny task.
CHAT_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_PAD, CHAT_IM_START, CHAT_IM_END = 0, 1, 2
# ChatML, rendered by the tokenizer's own template (Jinja, as in tokenizer_config.json of Qwen models).
CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHAT_ROLES = ("system", "user", "assistant")


def build_bpe_tokenizer(corpus, vocab_size=384):
    """A byte-level BPE trained on `corpus` (iterable of str) with ChatML specials.

    Digits are split one per token before the byte-level step (as Llama 3 and Qwen do), so
    arithmetic stays digit by digit while the chat scaffolding merges into few tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_SPECIALS), min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return tok


def save_chat_tokenizer(tok, path, max_length=512):
    """tokenizer.json + tokenizer_config.json carrying the chat template (as HF chat models ship)."""
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "pad_token": CHAT_SPECIALS[CHAT_PAD],
              "eos_token": CHAT_SPECIALS[CHAT_IM_END], "bos_token": None, "model_max_length": max_length,
              "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def _file_tokenizer(checkpoint_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(os.path.join(checkpoint_dir, "tokenizer.json"))


def load_hf_tokenizer(checkpoint_dir):
    """The checkpoint's tokenizer as its users load it (transformers.AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(checkpoint_dir)


def check_messages(messages, where):
    """UserError naming `where` unless `messages` is a non-empty list of {role, content} dicts."""
    from vime.errors import require

    require(isinstance(messages, list) and messages,
            f"{where}: expected a non-empty list of {{\"role\": ..., \"content\": ...}} messages")
    for i, m in enumerate(messages):
        require(isinstance(m, dict) and set(m) >= {"role", "content"} and isinstance(m["content"], str),
                f"{where}: message {i} must be a dict with a 'role' and a string 'content'")
        require(m["role"] in CHAT_ROLES, f"{where}: message {i} has unknown role {m['role']!r}; "
                f"use one of {list(CHAT_ROLES)}")


class TextCodec:
    """Encode/decode text with a checkpoint's tokenizer (the rollout's only tokenizer use).

    From a checkpoint directory it is the checkpoint's AutoTokenizer; from a `tokenizers.Tokenizer`
    in memory (pretraining) the same fast tokenizer without transformers."""

    def __init__(self, checkpoint_dir=None, tokenizer=None):
        """From a checkpoint's tokenizer files, or from a `tokenizers.Tokenizer` in memory."""
        self.hf = None if tokenizer is not None else load_hf_tokenizer(checkpoint_dir)
        self.tok = tokenizer or self.hf.backend_tokenizer
        # the file as written: AutoTokenizer may rebuild the model (a word-level vocabulary comes back
        # as BPE without its unk token, dropping unknown characters silently), so the vocabulary check
        # reads the tokenizer.json model itself
        self.file_tok = tokenizer or _file_tokenizer(checkpoint_dir)

    def encode(self, text):
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=False)
        return self.tok.encode(text, add_special_tokens=False).ids

    @property
    def has_chat_template(self):
        return self.hf is not None and bool(getattr(self.hf, "chat_template", None))

    def render_chat(self, messages):
        """The generation prompt's text for `messages`, by the tokenizer's own chat template."""
        return self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def chat_prompt_ids(self, messages):
        """Token ids of the chat template's rendering with the generation prompt (no BOS added:
        the template decides what starts a conversation)."""
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def prompt_ids(self, prompt, bos_token_id, apply_chat_template=False):
        """A data row's prompt -> ids: chat messages through the template, or raw text with BOS."""
        if apply_chat_template:
            return self.chat_prompt_ids(prompt)
        return self.encode_prompt(prompt, bos_token_id)

    def unknown_characters(self, text):
        """Characters of `text` the vocabulary lacks (the tokenizer would map them to its unk token)."""
        unk = getattr(self.file_tok.model, "unk_token", None)
        unk_id = self.file_tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return []
        enc = self.file_tok.encode(text, add_special_tokens=False)
        bad = [text[a:b] for i, (a, b) in zip(enc.ids, enc.offsets) if i == unk_id and text[a:b] != unk]
        return sorted(set(bad))

    def require_known(self, text, where):
        """UserError naming `where` when `text` has characters outside the vocabulary (never silent unk)."""
        from vime.errors import require

        bad = self.unknown_characters(text)
        require(not bad, f"{where}: characters {''.join(bad)!r} are not in the model's vocabulary (they would "
                "become the unknown token); remove them or use a checkpoint whose tokenizer has them")

    def encode_prompt(self, text, bos_token_id):
        """Prompt ids as the model was trained on them: BOS (when the model has one) + text."""
        return ([bos_token_id] if bos_token_id is not None else []) + self.encode(text)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size()


def codec_or_none(checkpoint_dir):
    """The checkpoint's TextCodec, or None when it ships no tokenizer.json (token-id prompts only)."""
    if not os.path.isfile(os.path.join(checkpoint_dir, "tokenizer.json")):
        return None
    return TextCodec(checkpoint_dir)
