#!/usr/bin/env bash
# The container image built and run for real in CI (tests/container_image.rs runs it).
#
#   .ci/docker.sh start DIR    install Debian's docker.io + debootstrap if missing, start containerd
#                              and dockerd in the background (data under DIR, socket DIR/docker.sock)
#   .ci/docker.sh build DIR    build the stand-in base images, then deploy/Dockerfile as kvgate:ci
#   .ci/docker.sh stop DIR     stop that dockerd and containerd by their pids and remove DIR
#
# Base images cannot be pulled here (no registry but the package registries), so the stand-ins are
# made locally and passed to deploy/Dockerfile as its RUST_IMAGE / RUNTIME_IMAGE build arguments:
#   kvgate-ci/debian:bookworm-slim       debootstrap --variant=minbase of bookworm, `docker import`ed
#   kvgate-ci/rust:1.95-slim-bookworm    that image + gcc/libc6-dev + this machine's Rust toolchain
#                                        and trust store (.ci/docker-builder.Dockerfile)
# Cargo inside the build fetches crates from crates.io (the build runs on the host network).
# CARGO_PROFILE (default dev) picks the image's cargo profile: release is fat LTO (~3x the time).
set -euo pipefail
cmd=${1:?usage: .ci/docker.sh start|build|stop DIR}
dir=${2:?usage: .ci/docker.sh start|build|stop DIR}
root=$(cd "$(dirname "$0")/.." && pwd)
export DOCKER_HOST="unix://$dir/docker.sock"
# Debian's client (/usr/bin/docker, 20.10): it drives the engine's built-in BuildKit with
# DOCKER_BUILDKIT=1. A newer client elsewhere on PATH would want the buildx plugin for that.
docker=/usr/bin/docker
export DOCKER_BUILDKIT=1

case "$cmd" in
start)
  if [ ! -x /usr/sbin/dockerd ] || [ ! -x /usr/sbin/debootstrap ] || [ ! -x "$docker" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      docker.io debootstrap iptables
  fi
  mkdir -p "$dir"
  # containerd is started here, not by dockerd: dockerd gives the containerd it spawns a fixed time
  # to answer and exits when it does not (seen once in CI while the workspace compiled beside it:
  # containerd booted in 7.4 s, dockerd had already given up). Our own containerd gets as long as it
  # needs; dockerd is pointed at its socket, and restarted (twice at most) if it still exits early.
  printf '%s\n' 'version = 2' \
    "root = \"$dir/containerd-root\"" "state = \"$dir/containerd-state\"" \
    'disabled_plugins = ["io.containerd.grpc.v1.cri"]' \
    '[grpc]' "  address = \"$dir/containerd.sock\"" \
    '[debug]' "  address = \"$dir/containerd-debug.sock\"" >"$dir/containerd.toml"
  setsid /usr/bin/containerd --config "$dir/containerd.toml" \
    >"$dir/containerd.log" 2>&1 </dev/null &
  echo $! >"$dir/containerd.pid.launch"
  up=
  for _ in $(seq 1 900); do
    if /usr/bin/ctr --address "$dir/containerd.sock" version >/dev/null 2>&1; then up=1; break; fi
    kill -0 "$(cat "$dir/containerd.pid.launch")" 2>/dev/null || break
    sleep 0.2
  done
  if [ -z "$up" ]; then
    echo "containerd did not come up; its log:" >&2
    tail -n 40 "$dir/containerd.log" >&2
    exit 1
  fi
  # No bridge and no iptables rules: the image's containers use the host network (the tests talk
  # to them on 127.0.0.1), so the daemon leaves the machine's firewall alone.
  for attempt in 1 2 3; do
    setsid /usr/sbin/dockerd --data-root "$dir/data" --exec-root "$dir/exec" \
      -H "$DOCKER_HOST" --pidfile "$dir/dockerd.pid" --containerd "$dir/containerd.sock" \
      --iptables=false --ip-masq=false --bridge=none \
      >>"$dir/dockerd.log" 2>&1 </dev/null &
    echo $! >"$dir/dockerd.pid.launch"
    for _ in $(seq 1 900); do
      "$docker" version >/dev/null 2>&1 && exit 0
      kill -0 "$(cat "$dir/dockerd.pid.launch")" 2>/dev/null || break
      sleep 0.2
    done
    # Still running after 180 s without answering: stop it before the next attempt.
    kill "$(cat "$dir/dockerd.pid.launch")" 2>/dev/null || true
    wait "$(cat "$dir/dockerd.pid.launch")" 2>/dev/null || true
    echo "dockerd attempt $attempt did not come up" >&2
  done
  echo "dockerd did not come up; its log:" >&2
  tail -n 40 "$dir/dockerd.log" >&2
  exit 1
  ;;
build)
  t0=$(date +%s)
  # ---- runtime stand-in: bookworm minbase, slimmed as debian:*-slim is (no docs, no apt cache).
  rootfs="$dir/rootfs"
  if ! "$docker" image inspect kvgate-ci/debian:bookworm-slim >/dev/null 2>&1; then
    rm -rf "$rootfs"
    debootstrap --variant=minbase bookworm "$rootfs" http://deb.debian.org/debian >"$dir/debootstrap.log" 2>&1 \
      || { tail -n 30 "$dir/debootstrap.log" >&2; exit 1; }
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin \
      "$rootfs"/var/lib/apt/lists/* \
      "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/*
    # As in Debian's official images: apt keeps no package caches or downloaded .debs in layers.
    printf '%s\n' 'Dir::Cache::pkgcache "";' 'Dir::Cache::srcpkgcache "";' \
      'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
      'APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };' \
      >"$rootfs/etc/apt/apt.conf.d/docker-clean"
    tar -C "$rootfs" -c . | "$docker" import --change 'CMD ["bash"]' - kvgate-ci/debian:bookworm-slim >/dev/null
    rm -rf "$rootfs"
  fi
  t1=$(date +%s)
  # ---- builder stand-in: its context is this machine's toolchain (hard links: no copy) and
  # trust store.
  sysroot=$(rustc --print sysroot)
  ctx="$dir/builder-ctx"
  rm -rf "$ctx" && mkdir -p "$ctx/rust/bin"
  for f in bin/cargo bin/rustc bin/rustdoc lib; do
    cp -al "$sysroot/$f" "$ctx/rust/$f" 2>/dev/null || cp -a "$sysroot/$f" "$ctx/rust/$f"
  done
  cp /etc/ssl/certs/ca-certificates.crt "$ctx/"
  "$docker" build -q --network host \
    -f "$root/.ci/docker-builder.Dockerfile" \
    --build-arg BASE=kvgate-ci/debian:bookworm-slim \
    -t kvgate-ci/rust:1.95-slim-bookworm "$ctx" >/dev/null
  rm -rf "$ctx"
  t2=$(date +%s)
  # ---- the image itself, as a user builds it, with the stand-ins as base images.
  "$docker" build --progress plain --network host -f "$root/deploy/Dockerfile" \
    --build-arg RUST_IMAGE=kvgate-ci/rust:1.95-slim-bookworm \
    --build-arg RUNTIME_IMAGE=kvgate-ci/debian:bookworm-slim \
    --build-arg CARGO_PROFILE="${CARGO_PROFILE:-dev}" \
    -t kvgate:ci "$root" >"$dir/build.log" 2>&1 \
    || { tail -n 60 "$dir/build.log" >&2; exit 1; }
  t3=$(date +%s)
  size=$("$docker" image inspect -f '{{.Size}}' kvgate:ci)
  echo "docker image kvgate:ci (CARGO_PROFILE=${CARGO_PROFILE:-dev}): $((size / 1000000)) MB;" \
    "base images $((t1 - t0)) s + $((t2 - t1)) s, image build $((t3 - t2)) s"
  ;;
stop)
  if [ -f "$dir/dockerd.pid.launch" ]; then
    pid=$(cat "$dir/dockerd.pid.launch")
    # Leftover containers first (a failed test may leave one), then the daemon itself.
    ids=$("$docker" ps -aq 2>/dev/null || true)
    [ -z "$ids" ] || "$docker" rm -f $ids >/dev/null 2>&1 || true
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # Then containerd (after dockerd, which stops its containers through it).
  if [ -f "$dir/containerd.pid.launch" ]; then
    pid=$(cat "$dir/containerd.pid.launch")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 150); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  # The overlay mounts are gone with the daemon; anything still mounted under DIR is unmounted first.
  grep -o " $dir/[^ ]*" /proc/mounts | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
  rm -rf "$dir"
  ;;
*)
  echo "usage: .ci/docker.sh start|build|stop DIR" >&2
  exit 2
  ;;
esac
