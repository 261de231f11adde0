fn main() {
    // Programs linked against the simulator record `libcuda.so.1`, as they
    // do with the real driver.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
