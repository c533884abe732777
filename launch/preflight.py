#!/usr/bin/env python
"""Check every node of a DeepSpeed hostfile before a multi-node run (launch/multinode.sh runs it first).

Usage:
    python launch/preflight.py --hostfile launch/hostfile [--num-nodes N] [--num-gpus N]
                               [--master-addr ADDR] [--master-port 29500] [--ssh-port 22]

Over the same passwordless ssh the DeepSpeed launcher (pdsh) will use, on every node it checks:
the node answers (BatchMode: no prompt may be needed); this checkout exists at the same path;
this Python interpreter exists at the same path (pdsh starts the remote ranks with it); torch,
deepspeed and ds_longseq import there, in the same versions, ds_longseq from the same sources
(a digest of its .py files); the hostfile's slots fit its devices (GPUs when it has any) and
NUM_GPUS; the master address resolves there. On the master node it checks that MASTER_PORT is
free. Every problem is reported at once, each naming its node; exit status 2 if there is any.
Standard library only on this side; the probe that runs on each node imports the packages.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# DeepSpeed's own hostfile rule (deepspeed/launcher/runner.py, _parse_hostfile).
HOSTFILE_LINE = re.compile(r"^(\S+)\s+slots=(\d+)")

# Runs on each node (python -c): one JSON line with what the node has.
PROBE = r"""
import hashlib, json, os, socket, sys
out = {"hostname": socket.gethostname(), "python": sys.version.split()[0], "errors": []}
arg = json.loads(sys.argv[1])
master, port = arg["master_addr"], arg["master_port"]
for path, what in ((arg["script"], "the training script"), (arg["cwd"], "the launch directory")):
    if not os.path.exists(path):
        out["errors"].append(f"{what} {path} does not exist here: every node needs the same paths")
# What the ranks will import: the launcher exports PYTHONPATH=<launch dir>:<this PYTHONPATH> to every node.
sys.path[:0] = [p for p in arg["pythonpath"] if p]
for name in ("torch", "deepspeed", "ds_longseq"):
    try:
        mod = __import__(name)
        out[name] = getattr(mod, "__version__", "?")
    except Exception as err:
        out["errors"].append(f"cannot import {name}: {type(err).__name__}: {err}")
if "ds_longseq" in out:
    import ds_longseq
    pkg = os.path.dirname(ds_longseq.__file__)
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in sorted(os.walk(pkg)):
        dirnames.sort()
        for f in sorted(filenames):
            if f.endswith(".py"):
                digest.update(f.encode())
                with open(os.path.join(dirpath, f), "rb") as fh:
                    digest.update(fh.read())
    out["ds_longseq_path"], out["ds_longseq_digest"] = pkg, digest.hexdigest()[:12]
if "torch" in out:
    import torch
    out["gpus"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
try:
    socket.getaddrinfo(master, port)
except OSError as err:
    out["errors"].append(f"the master address {master!r} does not resolve here: {err}")
if arg["is_master"]:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError as err:
            out["errors"].append(f"MASTER_PORT {port} is in use on this node, the master ({err.strerror}): "
                                 f"pick a free port (MASTER_PORT=...)")
print(json.dumps(out))
"""


def parse_hostfile(path: str) -> tuple[dict[str, int], list[str]]:
    """{host: slots} in file order, and the problems (bad lines, duplicates, no host)."""
    hosts: dict[str, int] = {}
    problems = []
    if not os.path.isfile(path):
        return hosts, [f"no hostfile at {path} (copy launch/hostfile.example and edit it, or set HOSTFILE)"]
    with open(path) as f:
        for number, raw in enumerate(f, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            match = HOSTFILE_LINE.match(line)
            if match is None:
                problems.append(f"{path}:{number}: {line!r} is not '<host> slots=<N>'")
            elif match.group(1) in hosts:
                problems.append(f"{path}:{number}: host {match.group(1)} is listed twice")
            else:
                hosts[match.group(1)] = int(match.group(2))
    if not hosts and not problems:
        problems.append(f"{path} lists no host")
    return hosts, problems


def probe(host: str, python: str, probe_args: dict, ssh_port: int | None, timeout: float) -> dict:
    """Run PROBE on ``host`` over ssh; the node's answer, or {"errors": [why it failed]}."""
    remote = [python, "-c", PROBE, json.dumps(probe_args)]
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(timeout)}"]
    cmd += ["-p", str(ssh_port)] if ssh_port else []
    cmd += [host, " ".join(shlex.quote(a) for a in remote)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout + 60)
    except subprocess.TimeoutExpired:
        return {"errors": [f"no answer over ssh within {timeout + 60:g} s"]}
    if proc.returncode == 255:
        last = (proc.stderr.strip().splitlines() or ["ssh failed"])[-1]
        return {"errors": [f"not reachable over passwordless ssh ({last}): `ssh {host} hostname` must work from "
                           "this node without a prompt (ssh-copy-id, known_hosts, the ssh port)"]}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return {"errors": [f"{python} does not run there ({tail}): every node needs this interpreter at the "
                           "same path (the launcher starts the remote ranks with it)"]}
    return json.loads(lines[-1])


def check(hosts: dict[str, int], answers: dict[str, dict], num_gpus: int | None) -> list[str]:
    """Problems across the nodes' answers, each naming its node."""
    problems = []
    for host, answer in answers.items():
        problems += [f"node {host}: {e}" for e in answer.get("errors", [])]
        slots = hosts[host]
        if num_gpus is not None and num_gpus > slots:
            problems.append(f"node {host}: NUM_GPUS={num_gpus} but the hostfile gives it slots={slots}: lower "
                            f"NUM_GPUS or raise its slots")
        gpus = answer.get("gpus")
        if gpus and slots > gpus:
            problems.append(f"node {host}: slots={slots} in the hostfile but {gpus} GPU(s) visible there: one rank "
                            "per GPU, so set slots <= its GPUs (or NUM_GPUS)")
    for key, what in (("python", "Python"), ("torch", "torch"), ("deepspeed", "deepspeed"),
                      ("ds_longseq", "ds_longseq"), ("ds_longseq_path", "ds_longseq's location"),
                      ("ds_longseq_digest", "ds_longseq's sources (digest of its .py files)")):
        values = {h: a[key] for h, a in answers.items() if key in a}  # the nodes that answered
        if len(set(values.values())) > 1:
            reference, want = next(iter(values.items()))  # the first node that answered
            for host, value in values.items():
                if value != want:
                    problems.append(f"node {host}: {what} is {value}, node {reference} has {want}: every node needs "
                                    "the same environment (same checkout, same pip install)")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hostfile", required=True)
    p.add_argument("--num-nodes", type=int, default=None, help="check only the first N hosts (deepspeed --num_nodes)")
    p.add_argument("--num-gpus", type=int, default=None, help="ranks per node asked for (deepspeed --num_gpus)")
    p.add_argument("--master-addr", default=None, help="default: the first host")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--ssh-port", type=int, default=None)
    p.add_argument("--python", default=sys.executable, help="interpreter the remote ranks run (default: this one)")
    p.add_argument("--timeout", type=float, default=10.0, help="ssh connect timeout per node, seconds")
    p.add_argument("--script", default=os.path.join(ROOT, "examples", "sft.py"), help="the training script")
    args = p.parse_args(argv)

    hosts, problems = parse_hostfile(args.hostfile)
    if args.num_nodes is not None:
        if args.num_nodes > len(hosts):
            problems.append(f"NUM_NODES={args.num_nodes} but {args.hostfile} lists {len(hosts)} host(s)")
        hosts = dict(list(hosts.items())[: args.num_nodes])
    if problems or not hosts:
        print("preflight: " + "\n  ".join(["FAILED:"] + problems), file=sys.stderr)
        return 2
    master_addr = args.master_addr or next(iter(hosts))
    master_host = master_addr if master_addr in hosts else next(iter(hosts))
    print(f"preflight: checking {len(hosts)} node(s) of {args.hostfile} over ssh (master {master_addr}:"
          f"{args.master_port}) ...", file=sys.stderr, flush=True)
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        cwd = os.getcwd()
        pythonpath = [cwd] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
        futures = {}
        for h in hosts:
            probe_args = {"master_addr": master_addr, "master_port": args.master_port, "is_master": h == master_host,
                          "script": os.path.abspath(args.script), "cwd": cwd, "pythonpath": pythonpath}
            futures[h] = pool.submit(probe, h, args.python, probe_args, args.ssh_port, args.timeout)
        answers = {h: f.result() for h, f in futures.items()}
    problems = check(hosts, answers, args.num_gpus)
    for host, a in answers.items():
        if "hostname" in a:
            print(f"  {host}: slots={hosts[host]} host={a['hostname']} python {a.get('python')} torch {a.get('torch')} "
                  f"deepspeed {a.get('deepspeed')} ds_longseq {a.get('ds_longseq')} ({a.get('ds_longseq_digest')}) "
                  f"gpus {a.get('gpus')}", file=sys.stderr)
    if problems:
        print("preflight: " + "\n  ".join(["FAILED:"] + problems), file=sys.stderr)
        return 2
    ranks = sum(hosts.values()) if args.num_gpus is None else args.num_gpus * len(hosts)
    print(f"preflight: OK, {len(hosts)} node(s), {ranks} rank(s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
