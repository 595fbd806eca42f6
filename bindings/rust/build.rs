//! Links libpkv: PKV_LIB_DIR names the folder holding libpkv.so (default: the checkout's build/),
//! and is also put in the binaries' rpath, so the tests run without LD_LIBRARY_PATH.
use std::env;
use std::path::PathBuf;

fn main() {
    let dir = match env::var("PKV_LIB_DIR") {
        Ok(d) => PathBuf::from(d),
        Err(_) => PathBuf::from(env::var("CARGO_MANIFEST_DIR").unwrap()).join("../../build"),
    };
    println!("cargo:rerun-if-env-changed=PKV_LIB_DIR");
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=dylib=pkv");
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", dir.display());
}
