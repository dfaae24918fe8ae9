//! What of CUDA is installed here, found out before anything starts that could abort: cudarc
//! panics where a library it loads is missing, so a command asks here first and can say in
//! one line why CUDA cannot be used. Also the early loading of NVRTC (and of cuBLAS, where its
//! GEMMs are asked for), beside the driver starting, that keeps opening the device short.

use cudarc::driver::CudaContext;

pub const CUDA_FIX: &str = "run on a machine with an NVIDIA GPU and its driver (libcuda) and NVRTC installed and on the library path (cuBLAS too before sm_80), or use --backend cpu";

/// Whether the CUDA driver library is missing: the quick check a command makes before it
/// starts opening the GPU in the background (`unavailable_reason` says everything, but loads
/// every library and starts the driver, hundreds of ms).
pub fn driver_missing() -> Option<String> {
    // Safety: only probes whether the shared library can be opened.
    (!unsafe { cudarc::driver::sys::is_culib_present() })
        .then(|| "the CUDA driver library (libcuda.so) was not found".into())
}

/// The name of GPU 0, from the driver alone (no context is created), if it can be read.
pub fn device_name() -> Option<String> {
    use cudarc::driver::result;
    result::init().ok()?;
    result::device::get_name(result::device::get(super::home_ordinal() as i32).ok()?).ok()
}

/// Says why CUDA cannot be used here, without touching anything that would abort.
pub fn unavailable_reason() -> Option<String> {
    // Safety: only probes whether the shared libraries can be opened.
    unsafe {
        if !cudarc::driver::sys::is_culib_present() {
            return Some("the CUDA driver library (libcuda.so) was not found".into());
        }
        if !cudarc::nvrtc::sys::is_culib_present() {
            return Some("NVRTC (libnvrtc.so) was not found".into());
        }
        if cublas_asked() && !cudarc::cublas::sys::is_culib_present() {
            return Some("cuBLAS (libcublas.so) was not found".into());
        }
    }
    match CudaContext::device_count() {
        Ok(n) if n > 0 => None,
        Ok(_) => Some("no CUDA device is visible".into()),
        Err(e) => Some(format!("the CUDA driver failed to start: {e}")),
    }
}

/// Loads the library cudarc will load for `lib` (the first of its names that opens) and keeps
/// it loaded, so that cudarc's own load later finds it in place; false if none opens.
/// `is_culib_present` would unload it again, and loading cuBLAS twice costs a hundred ms.
fn preload(lib: &str) -> bool {
    cudarc::get_lib_name_candidates(lib).iter().any(|name| {
        let Ok(name) = std::ffi::CString::new(name.as_str()) else {
            return false;
        };
        // Safety: loading a shared library runs its initialisers, as cudarc's load of the same
        // file does; the handle is never closed.
        !unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL) }.is_null()
    })
}

/// Whether NVRTC loads (kept loaded): cudarc panics on its first NVRTC call where it does not.
pub(super) fn nvrtc_loads() -> bool {
    preload("nvrtc")
}

/// Loads NVRTC (and cuBLAS where asked for) on another thread, beside the driver starting;
/// the thread says which one is missing.
pub(super) fn preload_libraries() -> std::thread::JoinHandle<Option<String>> {
    std::thread::spawn(|| {
        let _span = crate::support::timing::span("startup: NVRTC (+ cuBLAS) libraries loaded");
        if !preload("nvrtc") {
            return Some("NVRTC (libnvrtc.so) was not found".into());
        }
        if cublas_asked() && !preload("cublas") {
            return Some("cuBLAS (libcublas.so) was not found".into());
        }
        None
    })
}

/// Whether `KVDIFF_CUDA_GEMM=cublas` asks for cuBLAS's GEMMs.
pub fn cublas_asked() -> bool {
    std::env::var("KVDIFF_CUDA_GEMM").as_deref() == Ok("cublas")
}
