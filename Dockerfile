# syntax=docker/dockerfile:1.7
#
# kvroute's container image: a multi-stage build that compiles the router with the deployment
# profile (`cargo build --profile production -p kvroute`: fat LTO, one codegen unit) and ships
# only the binary and the shipped tokenizer on a distroless glibc base, as a non-root user.
#
#   docker build -t kvroute:0.1.0 .                      # the router (what deploy/kubernetes runs)
#   docker build --target sim -t kvroute-sim:e2e .       # the simulated engine, for scripts/e2e-kind.sh
#
# THIS FILE CANNOT BE BUILT ON THE PROJECT'S OWN MACHINES: they have no container engine (no
# docker, podman or buildah), so it has never been built there. What runs in CI and proves the
# fleet behaviour (scale-up, rolling update, restarts, partitions) is the process-level harness
# in crates/kvroute-fleet, which starts the same binaries as real OS processes on loopback.
#
# Why these choices:
# - distroless/cc: the binary links glibc (mimalloc, ring and zstd are compiled in), so a static
#   musl image would need another toolchain; cc-debian12 is glibc + libgcc + CA certificates,
#   no shell, ~25 MB, and its `nonroot` tag runs as uid/gid 65532.
# - BuildKit cache mounts keep the cargo registry and target directory between builds, so a
#   source change does not rebuild every dependency (LTO still relinks everything).
# - The builder's Rust matches the workspace's `rust-version`; edition 2024 needs >= 1.85.

ARG RUST_VERSION=1.89

FROM rust:${RUST_VERSION}-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --locked --profile production -p kvroute -p kvroute-sim \
 && mkdir -p /out \
 && cp target/production/kvroute target/production/kvroute-sim /out/

# The simulated engine (test fleets only; never a production image).
FROM gcr.io/distroless/cc-debian12:nonroot AS sim
COPY --from=build /out/kvroute-sim /usr/local/bin/kvroute-sim
COPY assets/tokenizer /opt/kvroute/tokenizer
USER 65532:65532
EXPOSE 8000 5557 5657
ENTRYPOINT ["/usr/local/bin/kvroute-sim", "--tokenizer-path", "/opt/kvroute/tokenizer/tokenizer.json"]

# The router: the default (last) stage.
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=build /out/kvroute /usr/local/bin/kvroute
COPY assets/tokenizer /opt/kvroute/tokenizer
USER 65532:65532
# 8080: the API (clients, /readyz, /metrics); 8081: the internal listener (siblings only).
EXPOSE 8080 8081
ENV KVROUTE_HOST=0.0.0.0 \
    KVROUTE_TOKENIZER_PATH=/opt/kvroute/tokenizer/tokenizer.json
ENTRYPOINT ["/usr/local/bin/kvroute"]
