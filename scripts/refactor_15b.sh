#!/usr/bin/env bash
# Issue 15 (import-graph tidy-up), the mechanical part: move modules to their one home and
# rewrite every reference to the old module paths. Idempotent: a second run changes nothing, so
# it can be replayed on a newer main (other branches' new code gets the same rewrite).
#
#   bash scripts/refactor_15b.sh        # from the repository root, then review `git diff`
#
# The hand-made changes that no script can do (one CRIU locator, PushResult's home, the
# gpu/ocispec and engine base-class edits) are separate commits on top of this one.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

# old file -> new file (modules first, then the tests that mirror them)
MOVES=(
  src/gpusnap/hostcheck.py:src/gpusnap/host/facts.py
  src/gpusnap/gpu/hostcheck.py:src/gpusnap/gpu/compat.py
  src/gpusnap/install.py:src/gpusnap/admin/install.py
  src/gpusnap/doctor.py:src/gpusnap/admin/doctor.py
  src/gpusnap/runc.py:src/gpusnap/runc/invoke.py
  src/gpusnap/runtime_shim/argv.py:src/gpusnap/runc/argv.py
  src/gpusnap/checkpoint/flows.py:src/gpusnap/checkpoint/runtime_steps.py
  src/gpusnap/engines/flows.py:src/gpusnap/engines/orchestrate.py
  tests/unit/engines/test_hostcheck.py:tests/unit/host/test_host_facts.py
  tests/unit/gpu/test_gpu_hostcheck.py:tests/unit/gpu/test_gpu_compat.py
  tests/unit/runtime_shim/test_shim_argv.py:tests/unit/runc/test_runc_argv.py
  tests/unit/checkpoint/test_checkpoint_flows.py:tests/unit/checkpoint/test_checkpoint_runtime_steps.py
  tests/unit/install/test_install_engines.py:tests/unit/admin/test_install_engines.py
  tests/unit/core/test_doctor_network_lock.py:tests/unit/admin/test_doctor_network_lock.py
)

new_package() {  # dir docstring
  mkdir -p "$1"
  if [ ! -e "$1/__init__.py" ]; then
    printf '"""%s"""\n' "$2" >"$1/__init__.py"
    git add "$1/__init__.py"
  fi
}
new_package src/gpusnap/host "Facts about this host (architecture, kernel, CRIU, GPUs) and whether it can take a given checkpoint."
new_package src/gpusnap/admin "Setting a host up for gpusnap and checking it: \`gpusnap install\` (registering with podman, docker, containerd) and \`gpusnap doctor\`."
new_package src/gpusnap/runc "The real runc: locating and running it (:mod:\`.invoke\`), reading its command line (:mod:\`.argv\`)."

for pair in "${MOVES[@]}"; do
  old=${pair%%:*} new=${pair#*:}
  if [ -e "$old" ] && [ ! -e "$new" ]; then
    mkdir -p "$(dirname "$new")"
    git mv "$old" "$new"
  elif [ -e "$old" ] && [ -e "$new" ]; then
    echo "refactor_15b: both $old and $new exist; merge them by hand" >&2
    exit 1
  fi
done
rmdir tests/unit/install 2>/dev/null || true

python3 - <<'PY'
import re
import subprocess
from pathlib import Path

# old module -> new module
MODULES = {
    "gpusnap.hostcheck": "gpusnap.host.facts",
    "gpusnap.gpu.hostcheck": "gpusnap.gpu.compat",
    "gpusnap.install": "gpusnap.admin.install",
    "gpusnap.doctor": "gpusnap.admin.doctor",
    "gpusnap.runc": "gpusnap.runc.invoke",
    "gpusnap.runtime_shim.argv": "gpusnap.runc.argv",
    "gpusnap.checkpoint.flows": "gpusnap.checkpoint.runtime_steps",
    "gpusnap.engines.flows": "gpusnap.engines.orchestrate",
}
# file paths named in docs, comments and tests (longest first, so a test path wins over its module)
PATHS = {
    "gpusnap/hostcheck.py": "gpusnap/host/facts.py",
    "gpu/hostcheck.py": "gpu/compat.py",
    "gpusnap/install.py": "gpusnap/admin/install.py",
    "gpusnap/doctor.py": "gpusnap/admin/doctor.py",
    "gpusnap/runc.py": "gpusnap/runc/invoke.py",
    "runtime_shim/argv.py": "runc/argv.py",
    "checkpoint/flows.py": "checkpoint/runtime_steps.py",
    "engines/flows.py": "engines/orchestrate.py",
    "unit/engines/test_hostcheck.py": "unit/host/test_host_facts.py",
    "test_gpu_hostcheck.py": "test_gpu_compat.py",
    "unit/runtime_shim/test_shim_argv.py": "unit/runc/test_runc_argv.py",
    "test_checkpoint_flows.py": "test_checkpoint_runtime_steps.py",
    "unit/install/test_install_engines.py": "unit/admin/test_install_engines.py",
    "unit/core/test_doctor_network_lock.py": "unit/admin/test_doctor_network_lock.py",
}
TEXT = (".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yaml", ".yml")
SKIP = ("scripts/refactor_15b.sh", "bench/results/")  # this script; recorded results stay as run


def dotted(old: str, new: str) -> re.Pattern[str]:
    # Not part of a longer name, and not already the new name (gpusnap.runc -> gpusnap.runc.invoke).
    guard = ""
    if new.startswith(old + "."):
        guard = r"(?!\." + re.escape(new[len(old) + 1:].split(".")[0]) + r"\b)"
    siblings = [n[len(old) + 1:].split(".")[0] for o, n in MODULES.items() if n.startswith(old + ".") and o != old]
    for s in siblings:  # gpusnap.runc.argv is a new module too, not gpusnap.runc.invoke.argv
        guard += r"(?!\." + re.escape(s) + r"\b)"
    if guard:  # `from gpusnap.runc import argv`: the package itself, already new
        subs = "|".join(re.escape(n[len(old) + 1:].split(".")[0]) for n in MODULES.values() if n.startswith(old + "."))
        guard += r"(?!\s+import\s+(?:" + subs + r")\b)"
    return re.compile(r"(?<![\w.])" + re.escape(old) + guard + r"(?![\w])")


def rewrite(text: str) -> tuple[str, list[str]]:
    warnings = []
    # `from gpusnap.engines import flows [as x]`: name the new module.
    for old, new in MODULES.items():
        opkg, oname = old.rsplit(".", 1)
        npkg, nname = new.rsplit(".", 1)
        pat = re.compile(r"^([ \t]*)from " + re.escape(opkg) + r" import " + oname + r"([ \t]+as[ \t]+\w+)?[ \t]*$", re.M)
        for m in list(pat.finditer(text)):
            alias = m.group(2)
            text = text.replace(m.group(0), f"{m.group(1)}from {npkg} import {nname}{alias or ''}", 1)
            if not alias and nname != oname:  # the module's local name changes: its uses too
                text = re.sub(r"(?<![\w.])" + oname + r"\.(?=\w)", nname + ".", text)
        multi = re.compile(r"^[ \t]*from " + re.escape(opkg) + r" import [^\n]*\b" + oname + r"\b", re.M)
        for m in multi.finditer(text):
            if not pat.match(m.group(0)):
                warnings.append(f"multi-name import of {old}: {m.group(0).strip()}")
    for old, new in MODULES.items():
        text = dotted(old, new).sub(new, text)
    for old, new in sorted(PATHS.items(), key=lambda kv: -len(kv[0])):
        text = re.sub(r"(?<![\w.])" + re.escape(old), new, text)
    return text, warnings


files = subprocess.run(["git", "ls-files", "-z"], capture_output=True, text=True, check=True).stdout.split("\0")
changed = 0
for name in files:
    if not name or name.startswith(SKIP) or not (name.endswith(TEXT) or name.startswith("bin/")):
        continue
    path = Path(name)
    if not path.is_file():
        continue
    old_text = path.read_text()
    new_text, warnings = rewrite(old_text)
    for w in warnings:
        print(f"refactor_15b: {name}: {w}; fix by hand")
    if new_text != old_text:
        path.write_text(new_text)
        changed += 1
print(f"refactor_15b: rewrote references in {changed} files")
PY
