# The forge server image (CPU). docs/deploy.md explains it; in short:
#
#   docker build -t forge .
#   docker run -p 8080:8080 -v /path/to/model.gguf:/models/model.gguf:ro forge
#
# The base images are arguments so that a builder behind a mirror (or with no registry
# at all) can name its own. Stages:
#   base      the runtime: no shell needed, a non-root user, port, health check, volume
#   prebuilt  base + a forge binary built outside (CI's release build, a cross build):
#             docker build --target prebuilt --build-arg FORGE_BINARY=target/release/forge .
#   build     compiles forge from this folder in a Rust image
#   runtime   base + the binary from `build` (the default target)
# `prebuilt` comes before `build` so that the legacy builder, which runs every stage up
# to its target, never needs the Rust image for it.

ARG BUILDER_IMAGE=rust:1.89-slim-bookworm
ARG RUNTIME_IMAGE=debian:bookworm-slim

FROM ${RUNTIME_IMAGE} AS base
LABEL org.opencontainers.image.title="forge" \
      org.opencontainers.image.description="batch_forge: an OpenAI-compatible LLM server with verifiable, batch-invariant outputs" \
      org.opencontainers.image.licenses="MIT OR Apache-2.0"
# Any uid works (the binary reads only the model); this one owns nothing in the image.
USER 10001:10001
EXPOSE 8080
VOLUME ["/models"]
# Ready means loaded and not draining; `forge health` needs no curl in the image.
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["forge", "health", "--url", "http://127.0.0.1:8080/health"]
# Listen on every interface, so that `docker run IMAGE serve -m /models/M.gguf` is reachable.
ENV FORGE_HOST=0.0.0.0
STOPSIGNAL SIGTERM
ENTRYPOINT ["forge"]
CMD ["serve", "-m", "/models/model.gguf"]

FROM base AS prebuilt
ARG FORGE_BINARY=target/release/forge
COPY ${FORGE_BINARY} /usr/local/bin/forge

FROM ${BUILDER_IMAGE} AS build
# --no-default-features: the CPU image carries no GPU code (docs/deploy.md has the
# Vulkan variant: FORGE_FEATURES="" and a runtime with a Vulkan driver).
ARG FORGE_FEATURES=--no-default-features
WORKDIR /src
COPY . .
RUN cargo build --release --locked ${FORGE_FEATURES} \
    && install -D -m 0755 target/release/forge /out/forge

FROM base AS runtime
COPY --from=build /out/forge /usr/local/bin/forge
