//! The gfal2 plugin API, generated from the installed headers by `build.rs`.

#![allow(
    non_upper_case_globals,
    non_camel_case_types,
    non_snake_case,
    dead_code,
    unused_imports,
    clippy::all,
    clippy::pedantic,
    rustdoc::all
)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));
