"""Tokenise the GSM8K-shaped benchmark workload once, on any machine, so the GPU run needs no tokenizer.

The workload: an 8-shot prefix of the first 8 train.jsonl examples in lm-eval's gsm8k format
("Question: ...\\nAnswer: ...\\n\\n"), followed by each of the 1319 test questions. Tokenised with the
embedded SmolLM2 tokenizer; its ids (< 49152) are valid in Llama-3.1's 128256-token vocabulary, and the
benchmark uses random weights, so only the lengths and the shared prefix matter.

    python benchmarks/make_gsm8k_tokens.py --data-dir ../shared/data/gsm8k
"""
import argparse
import json
from pathlib import Path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data-dir", default="../shared/data/gsm8k")
    ap.add_argument("--out", default=str(Path(__file__).parent / "data" / "gsm8k_8shot_tokens.json"))
    args = ap.parse_args()
    from attnzoo.models import loader

    tok = loader.load_tokenizer(loader.resolve_source(None))
    read = lambda name: [json.loads(line) for line in open(Path(args.data_dir) / name)]
    shots = read("train.jsonl")[:8]
    prefix = "".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
    prefix_ids = tok.encode(prefix, add_special_tokens=False)
    questions = [tok.encode(f"Question: {q['question']}\nAnswer:", add_special_tokens=False) for q in read("test.jsonl")]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"tokenizer": "SmolLM2-135M-Instruct", "prefix": prefix_ids, "questions": questions}))
    n = [len(prefix_ids) + len(q) for q in questions]
    print(f"{len(questions)} prompts, prefix {len(prefix_ids)} tokens, prompt lengths {min(n)}..{max(n)} -> {args.out}")


if __name__ == "__main__":
    main()
