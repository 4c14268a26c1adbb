"""Wall time to the first token, direct start vs ``wcache run --`` (CPU; docs/template.md).

    PYTHONPATH=$PWD python tests/template/measure.py [--repeats 3] [--mp 0|1|both]

Builds the bf16 SmolLM2 fixture, starts a template in a private socket dir, then
runs ``engine_script.py`` alternately directly (``python engine_script.py MODEL``)
and through the template (``wcache run -- python engine_script.py MODEL``), with
vLLM's engine core in a process of its own (``VLLM_ENABLE_V1_MULTIPROCESSING=1``,
vLLM's default) and in the engine's process (``=0``). Prints one JSON line per run
and a summary table (seconds from launching the command to the first token, and
to the command's exit).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "engine_script.py"


def run(cmd: list[str], env: dict[str, str]) -> dict:
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    t_end = time.time()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    out = json.loads(lines[-1])
    return {
        "ttft_s": round(out["first_token"] - t0, 2),
        "total_s": round(t_end - t0, 2),
        "text": out["text"],
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mp", choices=("0", "1", "both"), default="both")
    args = p.parse_args()
    from wcache.template.client import start_template, stop_template
    from wcache.testing.fixtures import build

    model = str(build("bf16"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.environ.update(env)
    sock_dir = tempfile.mkdtemp(prefix="wct-")
    os.chmod(sock_dir, 0o700)
    t0 = time.time()
    st = start_template(sock_dir)
    print(
        json.dumps(
            {
                "template_ready_s": round(time.time() - t0, 2),
                "import_s": st["import_s"],
                "modules": st["modules"],
                "rss_mib": st["rss_kib"] // 1024,
            }
        ),
        flush=True,
    )
    wrun = [
        sys.executable,
        "-m",
        "wcache.launcher",
        "run",
        "--no-fallback",
        "--socket-dir",
        sock_dir,
        "--",
    ]
    rows = {}
    try:
        for mp in ("0", "1") if args.mp == "both" else (args.mp,):
            e = {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": mp}
            for i in range(args.repeats):
                for how, prefix in (("direct", []), ("template", wrun)):
                    r = run(prefix + [sys.executable, str(SCRIPT), model], e)
                    r.update(how=how, mp=mp, repeat=i)
                    print(json.dumps(r), flush=True)
                    rows.setdefault((mp, how), []).append(r)
    finally:
        stop_template(sock_dir)
        shutil.rmtree(sock_dir, ignore_errors=True)
    print("\n| engine core | start | first token (s): median [min, max] | exit (s) | text |")
    print("|---|---|---|---|---|")
    for (mp, how), rs in rows.items():
        t = [r["ttft_s"] for r in rs]
        x = [r["total_s"] for r in rs]
        core = "own process (MP=1)" if mp == "1" else "in-process (MP=0)"
        print(
            f"| {core} | {how} | {statistics.median(t):.2f} [{min(t):.2f}, {max(t):.2f}] | "
            f"{statistics.median(x):.2f} | {rs[0]['text']!r} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
