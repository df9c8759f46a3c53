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

    def encode_prompt(self, text, bos_token_id):
        """Prompt ids as the model was trained on them: BOS (when the model has one) + text."""
        return ([bos_token_id] if bos_token_id is not None else []) + self.encode(text)

    def decode(self, ids):
        return self.tok.decode(ids, skip_special_tokens=True)

    @property
    def vocab_size(self):
        return self.tok.get_vocab_size()
