#!/usr/bin/env bash
# Provision a fresh Debian 12 machine (as root) with the real container stack the integration
# tests drive: runc, podman, docker.io + containerd (dockerd started, experimental on),
# docker-registry, skopeo, busybox-static, and CRIU >= 4.0 from Debian 13 in a private prefix
# (Debian 12's CRIU 3.17 fails on kernel 6.x and Debian 13's needs glibc 2.38: the host libc is
# never upgraded). Idempotent: every step checks before it acts, so running it twice is cheap.
set -euo pipefail

CRIU_PREFIX=${GPUSNAP_CRIU_PREFIX:-/opt/gpusnap-criu}
LOG=${GPUSNAP_PROVISION_LOG:-/tmp/gpusnap-provision.log}
export DEBIAN_FRONTEND=noninteractive

say() { printf '[provision] %s\n' "$*"; }

[ "$(id -u)" = 0 ] || { echo "provision.sh: must run as root (try: sudo $0)" >&2; exit 2; }

apt_ready=0
apt_update() { [ $apt_ready = 1 ] || { apt-get update -qq >>"$LOG" 2>&1; apt_ready=1; }; }

# ---- Debian 12 packages -------------------------------------------------------------------
# GPUSNAP_PROVISION=minimal (scripts/demo.sh) installs only what the embedded engine needs:
# runc, busybox and CRIU (and iptables: CRIU 4.1 locks a container's network namespace with
# iptables-restore); the default installs the whole stack the integration tests drive.
MODE=${GPUSNAP_PROVISION:-full}
if [ "$MODE" = minimal ]; then
  PKGS=(runc busybox-static iptables iproute2 nftables python3-venv procps)
else
  PKGS=(runc podman conmon crun docker.io containerd docker-registry skopeo busybox-static
        iptables nftables iproute2 uidmap fuse-overlayfs slirp4netns containernetworking-plugins
        zstd curl jq python3-venv procps psmisc e2fsprogs)
fi
missing=()
for p in "${PKGS[@]}"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing ${missing[*]}"
  apt_update
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$LOG" 2>&1
fi
# The docker-registry package starts its own service on :5000 on some hosts; tests start their own.
systemctl disable --now docker-registry >/dev/null 2>&1 || true

# ---- Debian 13 suite, pinned low so nothing else upgrades ---------------------------------
if ! grep -rqs trixie /etc/apt/sources.list.d/; then
  say "adding the trixie suite (pin 100)"
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    > /etc/apt/sources.list.d/trixie.sources
  printf 'Package: *\nPin: release n=trixie\nPin-Priority: 100\n' > /etc/apt/preferences.d/trixie
  apt_ready=0
fi

# ---- CRIU 4.x in a private prefix ----------------------------------------------------------
if ! "$CRIU_PREFIX/bin/criu" --version 2>/dev/null | grep -q 'Version: 4'; then
  say "installing CRIU 4.x into $CRIU_PREFIX"
  apt_update
  tmp=$(mktemp -d)
  (cd "$tmp" && apt-get download -t trixie criu libcompel1 libc6 libgnutls30t64 libnettle8t64 \
     libhogweed6t64 libunistring5 libp11-kit0 libidn2-0 libtasn1-6 libgmp10 libbsd0 libnet1 \
     libnftables1 libnl-3-200 libprotobuf-c1 libuuid1 libmd0 libjansson4 libmnl0 libnftnl11 \
     libxtables12 libffi8 libedit2 libtinfo6 libbz2-1.0 libzstd1 libseccomp2 >>"$LOG" 2>&1)
  rm -rf "$CRIU_PREFIX"; mkdir -p "$CRIU_PREFIX/bin" "$CRIU_PREFIX/root"
  for f in "$tmp"/*.deb; do dpkg -x "$f" "$CRIU_PREFIX/root"; done
  rm -rf "$tmp" "$CRIU_PREFIX/root/usr/share/doc" "$CRIU_PREFIX/root/usr/share/man"
  cat > "$CRIU_PREFIX/bin/criu" <<'EOS'
#!/bin/sh
# CRIU 4.x from Debian 13 with its own glibc, run through its own dynamic loader.
P=$(dirname "$(dirname "$(readlink -f "$0")")")/root
exec "$P/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$P/usr/lib/x86_64-linux-gnu" "$P/usr/sbin/criu" "$@"
EOS
  chmod 0755 "$CRIU_PREFIX/bin/criu"
fi
# ---- CRIU 4.2 beside it, for TCP sockets ----------------------------------------------------
# CRIU < 4.2 reads SO_PASSCRED/SO_PASSSEC from every socket; kernels >= 6.16 refuse that on TCP
# sockets, so no process holding a TCP socket can be dumped ("sockets: Can't get 1:16 opt").
# CRIU 4.2 has the fix; Debian ships it in sid only. apt runs with a private source list and
# state directory here, so the host's apt configuration is left exactly as it was.
CRIU42_PREFIX=${GPUSNAP_CRIU42_PREFIX:-/opt/gpusnap-criu42}
# sid_apt: a private apt for Debian sid in a new $apt_dir (debs land in $apt_dir/debs); callers
# use "${apt_opts[@]}" and remove $apt_dir when done.
sid_apt() {
  apt_dir=$(mktemp -d)
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/debs"
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian sid main" > "$apt_dir/sources.list"
  apt_opts=(-o "Dir::Etc::sourcelist=$apt_dir/sources.list" -o "Dir::Etc::sourceparts=-" -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache=$apt_dir/cache")
  apt-get "${apt_opts[@]}" update -qq >>"$LOG" 2>&1
}
install_criu42() {
  say "installing CRIU 4.2 (Debian sid) into $CRIU42_PREFIX"
  sid_apt
  (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download criu libcompel1 libc6 libgnutls30t64 libnettle8t64 \
     libhogweed6t64 libunistring5 libp11-kit0 libidn2-0 libtasn1-6 libgmp10 libbsd0 libnet9 \
     libnftables1 libnl-3-200 libprotobuf-c1 libuuid1 libmd0 libjansson4 libmnl0 libnftnl11 \
     libxtables12 libffi8 libedit2 libtinfo6 libbz2-1.0 libzstd1 libseccomp2 >>"$LOG" 2>&1)
  rm -rf "$CRIU42_PREFIX"; mkdir -p "$CRIU42_PREFIX/bin" "$CRIU42_PREFIX/root"
  for f in "$apt_dir"/debs/*.deb; do dpkg -x "$f" "$CRIU42_PREFIX/root"; done
  rm -rf "$apt_dir" "$CRIU42_PREFIX/root/usr/share/doc" "$CRIU42_PREFIX/root/usr/share/man"
  cat > "$CRIU42_PREFIX/bin/criu" <<'EOS'
#!/bin/sh
# CRIU 4.2 from Debian sid with its own glibc, run through its own dynamic loader.
P=$(dirname "$(dirname "$(readlink -f "$0")")")/root
exec "$P/usr/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2" --library-path "$P/usr/lib/x86_64-linux-gnu" "$P/usr/sbin/criu" "$@"
EOS
  chmod 0755 "$CRIU42_PREFIX/bin/criu"
  "$CRIU42_PREFIX/bin/criu" check >>"$LOG" 2>&1 || say "warning: CRIU 4.2 check failed; see $LOG"
}
# sid moves: a failed download leaves the tests that need TCP dumps to say so, not the whole run.
if [ "$MODE" != minimal ] && ! "$CRIU42_PREFIX/bin/criu" --version 2>/dev/null | grep -Eq 'Version: 4\.([2-9]|[1-9][0-9])'; then
  (set -e; install_criu42) || say "warning: CRIU 4.2 not installed (see $LOG); TCP-socket dumps need it on kernels >= 6.16"
fi
# ---- containerd 2.1 (Debian sid) beside the stack's 1.6, for the CRI tests ----------------
# containerd 2.1 restores a container whose pod image is a checkpoint image (CRI); 1.6 cannot.
# Its binaries need only glibc >= 2.34, so they run as they are. Unpacked into a private prefix
# (nothing on PATH, no service): tests/stack/cri.py starts its own daemon with its own socket,
# root, state and config, so the stack's containerd and dockerd never see it. The CRI api.proto
# (golang-k8s-cri-api-dev) comes along: gpusnap compiles its CRI client from it.
CTRD2_PREFIX=${GPUSNAP_CONTAINERD2_PREFIX:-/opt/gpusnap-containerd2}
install_containerd2() {
  say "installing containerd 2.x (Debian sid) into $CTRD2_PREFIX"
  sid_apt
  (cd "$apt_dir/debs" && apt-get "${apt_opts[@]}" download containerd golang-k8s-cri-api-dev >>"$LOG" 2>&1)
  rm -rf "$CTRD2_PREFIX"; mkdir -p "$CTRD2_PREFIX/bin" "$CTRD2_PREFIX/root" "$CTRD2_PREFIX/cri-api"
  for f in "$apt_dir"/debs/*.deb; do dpkg -x "$f" "$CTRD2_PREFIX/root"; done
  rm -rf "$apt_dir" "$CTRD2_PREFIX/root/usr/share/doc" "$CTRD2_PREFIX/root/usr/share/man"
  # The shim must be found first on the daemon's PATH: a 1.6 shim under a 2.1 daemon fails.
  for b in containerd containerd-shim-runc-v2 ctr; do ln -sf "../root/usr/bin/$b" "$CTRD2_PREFIX/bin/$b"; done
  cp "$CTRD2_PREFIX/root/usr/share/gocode/src/k8s.io/cri-api/pkg/apis/runtime/v1/api.proto" "$CTRD2_PREFIX/cri-api/api.proto"
  "$CTRD2_PREFIX/bin/containerd" --version >>"$LOG" 2>&1
}
if [ "$MODE" != minimal ] && ! "$CTRD2_PREFIX/bin/containerd" --version 2>/dev/null | grep -Eq ' v?2\.([1-9]|[1-9][0-9])\.'; then
  (set -e; install_containerd2) || say "warning: containerd 2.x not installed (see $LOG); the CRI tests (tests/integration/cri) will skip"
fi
# runc (and podman's runc) look CRIU up as `criu` on PATH.
ln -sf "$CRIU_PREFIX/bin/criu" /usr/local/sbin/criu
mkdir -p /etc/criu

if [ "$MODE" != minimal ]; then
# ---- peer tools from Debian 13 (Go binaries, no glibc 2.38 needed) ------------------------
for tool in checkpointctl oras; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    say "installing $tool (trixie)"
    apt_update
    apt-get install -y -qq --no-install-recommends -t trixie "$tool" >>"$LOG" 2>&1 || say "warning: $tool not installed"
  fi
done

# ---- rlimits: the hard nofile limit here is 20000, engines ask for more -------------------
mkdir -p /etc/containers
if ! grep -qs 'default_ulimits' /etc/containers/containers.conf; then
  say "lowering podman default ulimits"
  cat >> /etc/containers/containers.conf <<'EOS'
[containers]
default_ulimits = ["nofile=10000:10000", "nproc=4096:4096"]
EOS
fi

python3 - <<'PY'
import json, os
p = "/etc/docker/daemon.json"
os.makedirs("/etc/docker", exist_ok=True)
cfg = json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else {}
want = {"experimental": True,
        "default-ulimits": {"nofile": {"Name": "nofile", "Hard": 10000, "Soft": 10000},
                             "nproc": {"Name": "nproc", "Hard": 4096, "Soft": 4096}}}
if any(cfg.get(k) != v for k, v in want.items()):
    cfg.update(want)
    json.dump(cfg, open(p, "w"), indent=2)
    print("[provision] wrote", p)
PY

# ---- dockerd (with its containerd), started in the background if not answering ------------
if ! /usr/bin/docker info >/dev/null 2>&1; then
  say "starting dockerd"
  pgrep -x dockerd >/dev/null && pkill -x dockerd && sleep 2 || true
  PATH=/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin setsid nohup /usr/sbin/dockerd >/var/log/gpusnap-dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 60); do /usr/bin/docker info >/dev/null 2>&1 && break; sleep 1; done
  /usr/bin/docker info >/dev/null 2>&1 || { echo "dockerd did not start; see /var/log/gpusnap-dockerd.log" >&2; exit 1; }
fi

# ---- a busybox image for podman and docker, made locally (no pulls possible) --------------
if ! podman image exists localhost/gpusnap-busybox:latest 2>/dev/null || ! /usr/bin/docker image inspect gpusnap-busybox:latest >/dev/null 2>&1; then
  say "building the busybox image"
  tmp=$(mktemp -d); mkdir -p "$tmp"/{bin,tmp,proc,sys,dev,etc}
  cp /bin/busybox "$tmp/bin/busybox"
  for a in sh ls cat echo sleep seq nc httpd wc date true false kill ps head tail grep; do ln -sf busybox "$tmp/bin/$a"; done
  tar -C "$tmp" -cf "$tmp.tar" .
  podman import --quiet "$tmp.tar" localhost/gpusnap-busybox:latest >/dev/null
  /usr/bin/docker import "$tmp.tar" gpusnap-busybox:latest >/dev/null
  rm -rf "$tmp" "$tmp.tar"
fi

fi  # end of the full-stack part

"$CRIU_PREFIX/bin/criu" check >>"$LOG" 2>&1 || { echo "criu check failed; see $LOG" >&2; exit 1; }
if [ "$MODE" = minimal ]; then
  say "ready (minimal): $(runc --version | head -1), CRIU $("$CRIU_PREFIX/bin/criu" --version | head -1)"
else
  say "ready: $(runc --version | head -1), $(podman --version), $(/usr/bin/docker --version), CRIU $("$CRIU_PREFIX/bin/criu" --version | head -1)"
fi
