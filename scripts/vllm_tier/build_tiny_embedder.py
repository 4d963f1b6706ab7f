"""Build a tiny random BERT embedding model (WordPiece tokenizer + weights) for the vLLM tier.

No model can be downloaded on these machines, so the tier makes its own, as build_tiny_model.py
does for the language model:

* a WordPiece tokenizer (vocab ~1k, lower-cased, [CLS] text [SEP]) trained with `tokenizers` on
  build_tiny_model.py's generated corpus;
* a 2-layer BertModel (hidden 64, 2 heads, random weights, fixed seed), float32, architecture
  "BertModel": vLLM serves it as an embedding model (`--runner pooling`: CLS pooling, normalized)
  on /v1/embeddings.

The vectors mean nothing; the shapes and the usage (prompt_tokens = the tokenizer's count,
[CLS] and [SEP] included) are what the tests check.

    .venv-vllm/bin/python scripts/vllm_tier/build_tiny_embedder.py OUT_DIR [--force]

It writes OUT_DIR/.complete last; an existing complete OUT_DIR is left alone unless --force.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from build_tiny_model import corpus  # noqa: E402

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_LEN = 512
DIMENSIONS = 64


def build_tokenizer(vocab_size: int, seed: int):
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False)
    tok.train_from_iterator(corpus(seed, 3000), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
                                                       special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]", model_max_length=MAX_LEN,
                                   clean_up_tokenization_spaces=False)


def build(out_dir: str, *, seed: int = 0, vocab_size: int = 1024) -> None:
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    tokenizer = build_tokenizer(vocab_size, seed)
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=DIMENSIONS, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=DIMENSIONS * 2, max_position_embeddings=MAX_LEN, type_vocab_size=2,
                        pad_token_id=tokenizer.pad_token_id, architectures=["BertModel"])
    model = BertModel(config, add_pooling_layer=False).to(torch.float32).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    with open(os.path.join(tmp, "tiny_embedder_info.json"), "w") as f:
        json.dump({"seed": seed, "vocab": len(tokenizer), "dimensions": DIMENSIONS, "max_len": MAX_LEN}, f, indent=2)

    # Reload as vLLM will, and embed one text with transformers: the shapes must hold.
    again = AutoTokenizer.from_pretrained(tmp)
    ids = again("hello world", return_tensors="pt")
    assert ids["input_ids"][0, 0].item() == again.cls_token_id and ids["input_ids"][0, -1].item() == again.sep_token_id
    with torch.no_grad():
        hidden = BertModel.from_pretrained(tmp, add_pooling_layer=False).eval()(**ids).last_hidden_state
    assert hidden.shape == (1, ids["input_ids"].shape[1], DIMENSIONS), hidden.shape

    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    with open(os.path.join(out_dir, ".complete"), "w") as f:
        f.write("ok\n")


def main(argv=None) -> int:
    from build_tiny_model import build_cli  # its sibling: the script's directory is on sys.path

    return build_cli(build, "tiny embedder", __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    sys.exit(main())
