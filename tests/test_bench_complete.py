"""``localspec bench complete`` end to end on tiny inputs the test writes."""

import gzip
import json

from localspec.bench.complete import split_source, spread
from localspec.cli.main import main


def test_split_source_takes_about_n_tokens():
    text = "".join(f"line_{i} = {i}\n" for i in range(100))
    prefix, line, below = split_source(text, lambda s: s.split(), 30)
    assert prefix.startswith("line_0 = 0\n") and line and below.startswith("line_")
    assert 25 <= len((prefix + line).split()) <= 33


def test_spread():
    assert spread(list(range(10)), 3) == [0, 3, 6] and spread([1, 2], 5) == [1, 2]


def test_bench_complete_cli(tmp_path, capsys):
    tasks = [
        {"task_id": f"T/{i}", "prompt": "def add(a, b):\n", "suffix": "\n\nprint(add(1, 2))\n",
         "canonical_solution": "    return a + b\n", "entry_point": "add", "test": ""}
        for i in range(2)
    ]  # fmt: skip
    path = tmp_path / "infill.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("\n".join(json.dumps(t) for t in tasks))
    src = tmp_path / "src.py"
    src.write_text("".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60)))
    out = tmp_path / "r.json"
    args = ["bench", "complete", "--prefix-file", str(src), "--prefix-tokens", "200", "--repeats", "1",
            "--latency-n-predict", "4", "--humaneval", str(path), "--tasks", "2", "--n-predict", "8", "--out", str(out)]  # fmt: skip
    assert main(args) == 0
    d = json.loads(out.read_text())
    lat = d["latency"]
    assert lat["pairs"][0]["first_prompt_n"] == lat["prompt_tokens"] and lat["pairs"][0]["second_prompt_n"] < 20
    he = d["humaneval"]
    assert he["n_tasks"] == 2 and he["identical"] == 2 and len(he["tasks"]) == 2
    assert "latency: prompt" in capsys.readouterr().out
