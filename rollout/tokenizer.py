"""Character-level tokenizer for the tiny task, saved as a `tokenizer.json` AutoTokenizer loads."""
import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

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


class TextCodec:
    """Encode/decode text with a checkpoint's tokenizer.json (the engine's only tokenizer use)."""

    def __init__(self, checkpoint_dir=None, tokenizer=None):
        """From a checkpoint's tokenizer.json, or from a `tokenizers.Tokenizer` in memory."""
        self.tok = tokenizer or Tokenizer.from_file(os.path.join(checkpoint_dir, "tokenizer.json"))

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def unknown_characters(self, text):
        """Characters of `text` the vocabulary lacks (the tokenizer would map them to its unk token)."""
        unk = getattr(self.tok.model, "unk_token", None)
        unk_id = self.tok.token_to_id(unk) if unk else None
        if unk_id is None:
            return []
        enc = self.tok.encode(text, add_special_tokens=False)
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
