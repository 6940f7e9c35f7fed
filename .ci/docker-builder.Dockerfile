# CI's stand-in for rust:1.95-slim-bookworm (public base images cannot be pulled in CI): the
# debootstrapped bookworm image plus what the official image carries for a build (gcc, libc6-dev,
# CA certificates) and this machine's Rust toolchain, laid out like the official image
# (CARGO_HOME=/usr/local/cargo on PATH). Its trust store is this machine's, so cargo reaches
# crates.io the way the host does. Built by .ci/docker.sh from a context holding `rust/` (the
# toolchain's bin/cargo, bin/rustc, bin/rustdoc and lib/) and `ca-certificates.crt`.
ARG BASE
FROM ${BASE}
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev ca-certificates \
 && rm -rf /var/lib/apt/lists/*
COPY ca-certificates.crt /etc/ssl/certs/ca-certificates.crt
COPY rust /usr/local/rust
ENV CARGO_HOME=/usr/local/cargo \
    PATH=/usr/local/cargo/bin:/usr/local/rust/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
RUN mkdir -p /usr/local/cargo/bin && cargo --version && rustc --version
