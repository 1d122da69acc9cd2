"""LazyLLM schedules vs full attention on the five lighthouse questions (examples/questions.txt):
answers checked by keyword, mean TTFT, share of the prefill's (token, layer) pairs computed.

    PYTHONPATH=. python benchmarks/lazyllm_schedules.py        # ~3 min on 2 CPU cores
"""

from __future__ import annotations

from pathlib import Path

from kvcli.api import AskOptions, Session, read_document
from kvcli.pipeline import Pipeline

ROOT = Path(__file__).resolve().parent.parent
# a keyword (or |-separated alternatives) that a right answer to each question contains
EXPECTED = ["4-7-1-9", "Penhallow", "two white flashes", "Tobias Wren", "412|four hundred and twelve"]
SPECS = [
    "full",
    "lazyllm",
    "lazyllm:keep=0.9/0.8/0.7",
    "lazyllm:keep=0.8/0.7/0.6",
    "lazyllm:layers=15/20/25",
    "lazyllm:layers=15/20/25,keep=0.9/0.8/0.7",
]


def main() -> None:
    session = Session.open(AskOptions(use_cache=False, max_new_tokens=32))
    document = read_document(ROOT / "examples" / "lighthouse.pdf")
    lines = (ROOT / "examples" / "questions.txt").read_text().splitlines()
    questions = [q.strip() for q in lines if q.strip() and not q.startswith("#")]
    for spec in SPECS:
        correct, ttft, computed, answers = 0, 0.0, [], []
        for question, expected in zip(questions, EXPECTED):
            result = session.ask(document, question, Pipeline.parse(spec))
            good = any(x.lower() in result.answer.lower() for x in expected.split("|"))
            correct += good
            ttft += result.ttft_s
            computed.append(result.extra["method_stats"].get("prefill_tokens_computed_frac", 1.0))
            answers.append(("+ " if good else "- ") + " ".join(result.answer.split())[:60])
        n = len(questions)
        print(f"{spec:45s} {correct}/{n}  TTFT {ttft / n:.2f} s  prefill computed {sum(computed) / n:.2f}", flush=True)
        for answer in answers:
            print("    " + answer)


if __name__ == "__main__":
    main()
