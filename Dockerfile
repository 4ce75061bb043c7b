# callguard image: build with the Rust toolchain, run on Debian slim.
FROM rust:1-bookworm AS build
RUN apt-get update && apt-get install -y --no-install-recommends cmake libssl-dev pkg-config && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
RUN cargo build --release --locked && cp target/release/callguard /usr/local/bin/callguard

FROM debian:bookworm-slim
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates libssl3 && rm -rf /var/lib/apt/lists/*
COPY --from=build /usr/local/bin/callguard /usr/local/bin/callguard
COPY data /data
USER 65534
ENTRYPOINT ["callguard"]
CMD ["consume"]
