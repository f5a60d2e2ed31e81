//! Finds the system libfabric's headers with pkg-config, generates bindings
//! with bindgen, and compiles C wrappers for the header's `static inline` calls
//! (most of the `fi_*` API is inline dispatch through ops tables, so without
//! the wrappers there would be nothing to link against). The library itself is
//! not linked: the few functions it exports are loaded at first use (see
//! `src/lib.rs`), so nothing is emitted for the linker.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");

    let lib = pkg_config::Config::new()
        .atleast_version("1.10")
        .cargo_metadata(false)
        .probe("libfabric")
        .unwrap_or_else(|e| {
            panic!(
                "libfabric not found by pkg-config ({e}); on Debian: apt-get install libfabric-dev"
            )
        });

    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo always sets OUT_DIR"));
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let header = manifest.join("wrapper.h");
    let wrappers = out.join("fi_static_wrappers");

    let mut builder = bindgen::Builder::default()
        .header(header.to_string_lossy())
        .allowlist_function("fi_.*")
        // Exported by the shared library, which is loaded at run time: lib.rs defines them.
        .blocklist_function("fi_(getinfo|freeinfo|dupinfo|fabric|strerror)")
        .allowlist_type("fi_.*|fid.*")
        .allowlist_var("FI_.*")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(false)
        .wrap_static_fns(true)
        .wrap_static_fns_path(&wrappers)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .parse_callbacks(Box::new(FlagTypes));
    for path in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    builder
        .generate()
        .expect("bindgen failed on libfabric headers")
        .write_to_file(out.join("bindings.rs"))
        .expect("cannot write bindings.rs");

    let mut cc = cc::Build::new();
    cc.file(wrappers.with_extension("c"))
        .include(&manifest)
        .warnings(false);
    for path in &lib.include_paths {
        cc.include(path);
    }
    cc.compile("fi_static_wrappers");
}

/// Capability, mode and flag macros are 64-bit masks in libfabric, but cexpr
/// would type the small ones as `u32`; error numbers are plain `int`s.
#[derive(Debug)]
struct FlagTypes;

impl bindgen::callbacks::ParseCallbacks for FlagTypes {
    fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
        use bindgen::callbacks::IntKind;
        if name.starts_with("FI_E") && !name.starts_with("FI_EP_") {
            Some(IntKind::I32)
        } else if name.starts_with("FI_") {
            Some(IntKind::U64)
        } else {
            None
        }
    }
}
