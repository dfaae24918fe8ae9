//! kernels/*.cu compiled by NVRTC for the device, in units compiled side by side, each cached
//! on disk by its source and architecture; where the binary ships a unit's cubin for the
//! device's architecture, built from today's source (`shipped.rs`), nothing is compiled. As one
//! program the sources took NVRTC 9–13 s on an H200 host whose driver had not compiled them
//! before (its own compile cache, `~/.nv/ComputeCache`, serves a source it has seen), most of
//! it ptxas optimising the attention and tensor-core kernels one after another; as units on
//! threads of their own, each spreading its optimisation over the cores (`--split-compile`),
//! the longest unit sets the time. A change to one file recompiles its unit only.

use cudarc::nvrtc::{CompileOptions, Ptx};

use crate::error::{Error, Result};
use crate::support::timing::span;

/// What every unit starts with (after `MAX_SIDES`): the types and helpers all files share.
const COMMON: &str = include_str!("../../../kernels/common.cuh");

/// One NVRTC program, one module: files concatenated in this order after `COMMON`.
pub(super) struct Unit {
    pub(super) name: &'static str,
    /// Its compile's timing span.
    span: &'static str,
    pub(super) files: &'static [(&'static str, &'static str)],
    /// Whether its kernels take `Sides` and so are compiled for the run's side count; the
    /// others are compiled once, for `UNSIDED`.
    pub(super) sided: bool,
    /// Whether it is built for the architecture's own features on sm_90 (`sm_90a`: its
    /// kernels take warpgroup MMAs there), which a cubin of it keeps to sm_90 devices.
    pub(super) arch_features: bool,
}

/// The target `u` is compiled for on a device of `arch` (`sm_90`, `compute_90`).
pub(super) fn target(u: &Unit, arch: &str) -> String {
    match arch {
        "sm_90" | "compute_90" if u.arch_features => format!("{arch}a"),
        _ => arch.to_string(),
    }
}

/// The `MAX_SIDES` of a unit whose kernels take no `Sides`.
pub(super) const UNSIDED: usize = 1;

/// The units, all started at once. A unit holds every file its kernels call into:
/// attention.cu's decode kernels normalise and turn queries with norm.cu's and rope.cu's
/// device functions.
pub(super) const UNITS: &[Unit] = &[
    Unit {
        name: "attention",
        span: "startup: NVRTC compile, attention unit (cold cache)",
        files: &[
            ("norm.cu", include_str!("../../../kernels/norm.cu")),
            ("rope.cu", include_str!("../../../kernels/rope.cu")),
            (
                "attention.cu",
                include_str!("../../../kernels/attention.cu"),
            ),
        ],
        sided: true,
        arch_features: false,
    },
    Unit {
        name: "attention_mma",
        span: "startup: NVRTC compile, attention_mma unit (cold cache)",
        files: &[
            (
                "attention_wgmma.cu",
                include_str!("../../../kernels/attention_wgmma.cu"),
            ),
            (
                "attention_mma.cu",
                include_str!("../../../kernels/attention_mma.cu"),
            ),
            (
                "attention_diff_mma.cu",
                include_str!("../../../kernels/attention_diff_mma.cu"),
            ),
        ],
        sided: false,
        arch_features: true,
    },
    Unit {
        name: "gemv",
        span: "startup: NVRTC compile, gemv unit (cold cache)",
        files: &[("gemv.cu", include_str!("../../../kernels/gemv.cu"))],
        sided: true,
        arch_features: false,
    },
    Unit {
        name: "oracle",
        span: "startup: NVRTC compile, oracle unit (cold cache)",
        files: &[("oracle.cu", include_str!("../../../kernels/oracle.cu"))],
        sided: false,
        arch_features: false,
    },
    Unit {
        name: "gemm",
        span: "startup: NVRTC compile, gemm unit (cold cache)",
        files: &[("gemm.cu", include_str!("../../../kernels/gemm.cu"))],
        sided: false,
        arch_features: false,
    },
    Unit {
        name: "agreement",
        span: "startup: NVRTC compile, agreement unit (cold cache)",
        files: &[(
            "agreement.cu",
            include_str!("../../../kernels/agreement.cu"),
        )],
        sided: true,
        arch_features: false,
    },
    Unit {
        name: "elementwise",
        span: "startup: NVRTC compile, elementwise unit (cold cache)",
        files: &[
            (
                "elementwise.cu",
                include_str!("../../../kernels/elementwise.cu"),
            ),
            ("diff.cu", include_str!("../../../kernels/diff.cu")),
        ],
        sided: false,
        arch_features: false,
    },
];

/// A unit's module image, and how to make it again where the device refuses a shipped cubin
/// (a driver older than the NVRTC that built it).
pub(super) struct UnitImage {
    pub(super) image: Ptx,
    pub(super) unit: &'static Unit,
    /// Whether the image is the one shipped in the binary.
    pub(super) shipped: bool,
    source: String,
    capability: (i32, i32),
}

impl UnitImage {
    /// The unit compiled here (from the cache or by NVRTC), not the shipped cubin.
    pub(super) fn compiled_here(&self) -> Result<Ptx> {
        let (major, minor) = self.capability;
        compiled_image(self.unit, &self.source, major, minor)
    }
}

/// Every unit's module image for `sm_{major}{minor}` with `Sides` of `sides` slots: the cubin
/// shipped in the binary where one was built from today's source for this architecture, else
/// cubins from the cache or NVRTC (PTX where NVRTC cannot target the device). Needs no CUDA
/// context, so the GPU's opening runs it beside the context's creation.
pub(super) fn kernel_images(major: i32, minor: i32, sides: usize) -> Result<Vec<UnitImage>> {
    let _span = span("startup: kernels (shipped, cached or compiled by NVRTC)");
    let arch = format!("sm_{major}{minor}");
    // `KVDIFF_CUDA_SHIPPED_KERNELS=0` compiles as a build without them would: to time it, or
    // to compare the two.
    let use_shipped = std::env::var("KVDIFF_CUDA_SHIPPED_KERNELS").as_deref() != Ok("0");
    std::thread::scope(|s| {
        let jobs: Vec<_> = UNITS
            .iter()
            .map(|u| {
                let arch = arch.as_str();
                s.spawn(move || {
                    let source = unit_source(u, sides);
                    let shipped =
                        super::shipped::cubin(arch, u.name, unit_sides(u, sides)).filter(|c| {
                            use_shipped && c.hash == source_hash(&source, &target(u, arch))
                        });
                    let (image, shipped) = match shipped {
                        Some(c) => (Ptx::from_binary(c.cubin.to_vec()), true),
                        None => (compiled_image(u, &source, major, minor)?, false),
                    };
                    Ok(UnitImage {
                        image,
                        unit: u,
                        shipped,
                        source,
                        capability: (major, minor),
                    })
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .map_err(|_| Error::Internal("compiling the kernels panicked".into()))?
            })
            .collect()
    })
}

/// The `MAX_SIDES` unit `u` is compiled with in a run of `sides`.
pub(super) fn unit_sides(u: &Unit, sides: usize) -> usize {
    if u.sided {
        sides
    } else {
        UNSIDED
    }
}

/// A unit's program: `MAX_SIDES` defined first (kernels/common.cuh sizes `Sides` by it).
pub(super) fn unit_source(u: &Unit, sides: usize) -> String {
    let sides = unit_sides(u, sides);
    let mut s = format!("#define MAX_SIDES {sides}\n// ---- common.cuh\n{COMMON}\n");
    for (name, src) in u.files {
        s.push_str(&format!("// ---- {name}\n{src}\n"));
    }
    s
}

/// The key of `source` compiled for `arch` (`sm_90`, `compute_90`): the same in every build of
/// kvdiff, so the cache and the shipped cubins' `sources.txt` agree.
pub(super) fn source_hash(source: &str, arch: &str) -> u64 {
    use crate::support::cache::{fnv1a, FNV_START};
    fnv1a(
        fnv1a(fnv1a(FNV_START, arch.as_bytes()), b"\0"),
        source.as_bytes(),
    )
}

fn compiled_image(u: &Unit, source: &str, major: i32, minor: i32) -> Result<Ptx> {
    // A cubin for the device itself loads as is; PTX would be compiled by the driver on every
    // run (hundreds of ms). PTX stays the fallback where NVRTC does not know the device.
    match compiled_cubin(u, source, major, minor) {
        Ok(cubin) => Ok(Ptx::from_binary(cubin)),
        Err(_) => compiled_ptx(u, source, major, minor),
    }
}

/// The cache entry of `unit`'s `source` compiled for `arch`.
fn entry(unit: &str, source: &str, arch: &str, ext: &str) -> String {
    format!(
        "kernels-{unit}-{arch}-{:016x}.{ext}",
        source_hash(source, arch)
    )
}

/// `source` as a cubin for `sm_{major}{minor}`, from the cache or compiled by NVRTC (and
/// cached); an error where NVRTC cannot target the device.
fn compiled_cubin(u: &Unit, source: &str, major: i32, minor: i32) -> Result<Vec<u8>> {
    let (unit, arch) = (u.name, target(u, &format!("sm_{major}{minor}")));
    let name = entry(unit, source, &arch, "cubin");
    let file = crate::support::cache::path(&name);
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        return Ok(bytes);
    }
    let _span = span(u.span);
    let cubin = nvrtc_cubin_for(source, &arch)
        .map_err(|e| Error::Internal(format!("NVRTC cubin of {unit} for {arch}: {e}")))?;
    // Best effort: a read-only cache folder only costs a recompile next time.
    crate::support::cache::write(&name, &cubin);
    Ok(cubin)
}

/// `source` compiled by NVRTC to a cubin for `arch` (`sm_90`), as runs and the shipped cubins
/// compile it.
pub(super) fn nvrtc_cubin_for(source: &str, arch: &str) -> std::result::Result<Vec<u8>, String> {
    let arch_opt = format!("--gpu-architecture={arch}");
    // `--split-compile=0`: optimisation spread over every core (NVRTC 12.1 and later); an
    // NVRTC that does not know it compiles without.
    let cubin = nvrtc_cubin(source, &[arch_opt.as_str(), "--split-compile=0"])
        .or_else(|_| nvrtc_cubin(source, &[arch_opt.as_str()]))?;
    if cubin.is_empty() {
        return Err("empty cubin".into());
    }
    Ok(cubin)
}

fn nvrtc_cubin(source: &str, options: &[&str]) -> std::result::Result<Vec<u8>, String> {
    use cudarc::nvrtc::{result, sys};
    let src = std::ffi::CString::new(source).map_err(|_| "source has a NUL".to_string())?;
    let prog = result::create_program(&src, None).map_err(|e| e.to_string())?;
    // Safety: `prog` is a live program; it is destroyed below on every path.
    unsafe {
        let compiled = result::compile_program(prog, options).map_err(|e| e.to_string());
        let cubin = compiled.and_then(|()| {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size)
                .result()
                .map_err(|e| e.to_string())?;
            let mut buf = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut std::ffi::c_char)
                .result()
                .map_err(|e| e.to_string())?;
            Ok(buf)
        });
        let _ = result::destroy_program(prog);
        cubin
    }
}

/// PTX of `source` for the device's architecture: from the on-disk cache when the source and
/// architecture match, else compiled by NVRTC and cached.
fn compiled_ptx(u: &Unit, source: &str, major: i32, minor: i32) -> Result<Ptx> {
    let (unit, arch) = (u.name, target(u, &format!("compute_{major}{minor}")));
    let name = entry(unit, source, &arch, "ptx");
    let file = crate::support::cache::path(&name);
    if let Some(text) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(Ptx::from_src(text));
    }
    let opts = CompileOptions {
        arch: Some(Box::leak(arch.clone().into_boxed_str())),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, opts)
        .map_err(|e| Error::Internal(format!("NVRTC compile of kernels/*.cu ({unit}): {e}")))?;
    crate::support::cache::write(&name, ptx.to_src().as_bytes());
    Ok(ptx)
}

#[cfg(test)]
mod tests {
    use super::{target, unit_source, UNITS};

    /// Every kernel source is in exactly one unit (common.cuh in all of them), so every kernel
    /// is compiled once.
    #[test]
    fn every_kernel_file_is_in_one_unit() {
        let mut files: Vec<String> =
            std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/kernels"))
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".cu"))
                .collect();
        files.sort();
        let mut listed: Vec<String> = UNITS
            .iter()
            .flat_map(|u| u.files.iter().map(|f| f.0.to_string()))
            .collect();
        listed.sort();
        assert_eq!(files, listed);
    }

    /// Each unit compiles on its own, and every kernel kvdiff launches is defined by exactly
    /// one of them: PTX, which needs no GPU. Skipped where NVRTC is not installed, unless
    /// `KVDIFF_REQUIRE_NVRTC` is set (CI installs NVRTC from PyPI).
    #[test]
    fn the_units_compile_and_define_every_kernel_once() {
        if !super::super::libraries::nvrtc_loads() {
            assert!(
                std::env::var_os("KVDIFF_REQUIRE_NVRTC").is_none(),
                "KVDIFF_REQUIRE_NVRTC is set, but NVRTC (libnvrtc.so) is not on the library path"
            );
            eprintln!("skipped: NVRTC (libnvrtc.so) was not found");
            return;
        }
        let ptx: Vec<String> = std::thread::scope(|s| {
            let jobs: Vec<_> = UNITS
                .iter()
                .map(|u| {
                    s.spawn(move || {
                        let arch: &'static str = target(u, "compute_90").leak();
                        let opts = cudarc::nvrtc::CompileOptions {
                            arch: Some(arch),
                            ..Default::default()
                        };
                        cudarc::nvrtc::compile_ptx_with_opts(unit_source(u, 5), opts)
                            .unwrap_or_else(|e| panic!("unit {}: {e}", u.name))
                            .to_src()
                    })
                })
                .collect();
            jobs.into_iter().map(|j| j.join().unwrap()).collect()
        });
        for k in super::super::kernels::KERNELS {
            let entry = format!(".entry {k}(");
            let units: Vec<&str> = UNITS
                .iter()
                .zip(&ptx)
                .filter(|(_, p)| p.contains(&entry))
                .map(|(u, _)| u.name)
                .collect();
            assert_eq!(units.len(), 1, "kernel {k} is defined in {units:?}");
        }
        // The oracle's products take another path before sm_90 (m8n8k4), and before sm_80
        // (FMAs); the tensor-core attention takes `mma.sync` where it is not built for sm_90a:
        // those compile too.
        let unit = |name: &str| UNITS.iter().find(|u| u.name == name).expect("a unit");
        for (name, kernel) in [
            ("oracle", "oracle_gemm_f64"),
            ("attention_mma", "attention_diff_mma"),
        ] {
            for arch in ["compute_80", "compute_75"] {
                let opts = cudarc::nvrtc::CompileOptions {
                    arch: Some(arch),
                    ..Default::default()
                };
                let ptx = cudarc::nvrtc::compile_ptx_with_opts(unit_source(unit(name), 1), opts)
                    .unwrap_or_else(|e| panic!("unit {name} at {arch}: {e}"))
                    .to_src();
                assert!(
                    ptx.contains(&format!(".entry {kernel}(")),
                    "{name} at {arch}"
                );
                assert!(!ptx.contains("wgmma"), "{name} at {arch}");
            }
        }
        let mma = UNITS
            .iter()
            .zip(&ptx)
            .find(|(u, _)| u.name == "attention_mma");
        assert!(mma.expect("a unit").1.contains("wgmma.mma_async"));
    }
}
