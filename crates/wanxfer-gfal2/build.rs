//! Generates the gfal2 plugin API bindings from the installed headers (found with
//! pkg-config, `gfal_transfer` bringing `gfal2` and glib along) and links the libraries
//! gfal2's own plugins link: the plugin calls back into gfal2 for configuration, errors,
//! events and progress. bindgen's layout tests check every generated struct against
//! what clang computes from the same header, so a field out of place fails the build.

use std::env;
use std::path::PathBuf;

fn main() {
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed=build.rs");
    let lib = pkg_config::Config::new()
        .atleast_version("2.21")
        .probe("gfal_transfer")
        .unwrap_or_else(|e| {
            panic!("gfal2 not found by pkg-config ({e}); on Debian: apt-get install libgfal2-dev")
        });
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo always sets OUT_DIR"));
    let mut builder = bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg("-D__GFAL2_H_INSIDE__")
        .allowlist_type("gfal_plugin_interface|plugin_mode|gfal_url2_check|gfalt_.*|_gfalt_.*")
        .allowlist_type("gfal_event_side_t|gfal2_context_t|gfal_file_handle")
        .allowlist_function("gfal2_set_error|gfal2_get_opt_(string|integer)_with_default")
        .allowlist_function("gfal_file_handle_(new|get_fdesc|delete)|gfal2_is_canceled")
        .allowlist_function("plugin_trigger_(event|monitor)|gfalt_set_error")
        .allowlist_function("gfalt_get_(checksum|strict_copy_mode|replace_existing_file)")
        .allowlist_function("gfalt_get_(create_parent_dir|nbstreams)")
        .allowlist_function("g_(free|error_free|quark_from_static_string)")
        .allowlist_var(
            "GFAL_EVENT_.*|GFAL_PLUGIN_.*|GFAL_FILE_COPY|GFAL_BULK_COPY|GFALT_CHECKSUM_.*",
        )
        // struct stat and struct dirent are libc's; the plugin fills them with libc's types.
        .blocklist_type("stat|dirent")
        .raw_line("pub use libc::{dirent, stat};")
        .prepend_enum_name(false)
        .derive_default(true)
        .layout_tests(true)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    for path in &lib.include_paths {
        builder = builder.clang_arg(format!("-I{}", path.display()));
    }
    builder
        .generate()
        .expect("bindgen failed on the gfal2 headers")
        .write_to_file(out.join("bindings.rs"))
        .expect("cannot write bindings.rs");
}
