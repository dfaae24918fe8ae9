//! Cubins of the kernel units built ahead of time and shipped in the binary, so that the first
//! run on a device of their architecture compiles nothing: NVRTC took 2.6–3.3 s on a 16-core
//! H200 host (and longer on fewer cores) before a first run could start.
//!
//! A shipped cubin is used only where `kernels/cubin/ARCH/sources.txt` records the hash of the
//! very source the run would compile (`compile::source_hash`); a kernel changed without its
//! cubins rebuilt is compiled by NVRTC as before, and the test below fails until they are
//! rebuilt. NVRTC builds them without a GPU:
//! `KVDIFF_UPDATE_CUBINS=1 cargo test --release --lib shipped_cubins` with NVRTC on the library
//! path (docs/gpu-backend.md). A device whose driver refuses one (older than the NVRTC that
//! built it) gets the unit compiled here instead (`kernels::load_kernels`).

/// One shipped cubin: unit `unit` compiled for `arch` with `MAX_SIDES` = `sides`.
pub(super) struct Shipped {
    pub(super) arch: &'static str,
    pub(super) unit: &'static str,
    pub(super) sides: usize,
    pub(super) cubin: &'static [u8],
}

/// A shipped cubin and the source hash it was built from.
pub(super) struct Found {
    pub(super) cubin: &'static [u8],
    pub(super) hash: u64,
}

macro_rules! shipped {
    ($arch:literal: $($unit:literal $sides:literal),* $(,)?) => {
        &[$(Shipped {
            arch: $arch,
            unit: $unit,
            sides: $sides,
            cubin: include_bytes!(concat!(
                env!("CARGO_MANIFEST_DIR"), "/kernels/cubin/", $arch, "/", $unit, "-", $sides,
                ".cubin"
            )),
        }),*]
    };
}

/// sm_90 (H100, H200): every unit for the side counts runs compile for by default (2 to
/// `WIDE_MAX_SIDES`; 1 for the units that take no `Sides`).
const SM_90: &[Shipped] = shipped!("sm_90":
    "attention" 2, "attention" 3, "attention" 4, "attention" 5,
    "attention" 6, "attention" 7, "attention" 8,
    "gemv" 2, "gemv" 3, "gemv" 4, "gemv" 5, "gemv" 6, "gemv" 7, "gemv" 8,
    "agreement" 2, "agreement" 3, "agreement" 4, "agreement" 5,
    "agreement" 6, "agreement" 7, "agreement" 8,
    "attention_mma" 1, "oracle" 1, "gemm" 1, "elementwise" 1,
);

/// `sources.txt` of each shipped architecture: `UNIT-SIDES HASH` a line.
const SOURCES: &[(&str, &str)] = &[(
    "sm_90",
    include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/kernels/cubin/sm_90/sources.txt"
    )),
)];

pub(super) fn all() -> impl Iterator<Item = &'static Shipped> {
    SM_90.iter()
}

/// The hash `sources.txt` records for `arch`'s `unit` at `sides`.
fn recorded_hash(arch: &str, unit: &str, sides: usize) -> Option<u64> {
    let (_, text) = SOURCES.iter().find(|(a, _)| *a == arch)?;
    let key = format!("{unit}-{sides}");
    text.lines().find_map(|l| {
        let (k, h) = l.split_once(' ')?;
        (k == key).then(|| u64::from_str_radix(h.trim(), 16).ok())?
    })
}

/// The cubin shipped for `unit` at `sides` on `arch`, with the hash of the source it was built
/// from; `None` where none is shipped.
pub(super) fn cubin(arch: &str, unit: &str, sides: usize) -> Option<Found> {
    let s = all().find(|s| s.arch == arch && s.unit == unit && s.sides == sides)?;
    Some(Found {
        cubin: s.cubin,
        hash: recorded_hash(arch, unit, sides)?,
    })
}

#[cfg(test)]
mod tests {
    use super::super::compile::{source_hash, target, unit_sides, unit_source, UNITS, UNSIDED};
    use super::super::kernels::WIDE_MAX_SIDES;
    use super::*;

    /// Every unit is shipped for sm_90 at every side count a run compiles it for by default.
    #[test]
    fn every_unit_is_shipped_for_sm_90_at_every_default_side_count() {
        for u in UNITS {
            for sides in 2..=WIDE_MAX_SIDES {
                let sides = unit_sides(u, sides);
                assert!(
                    all().any(|s| s.arch == "sm_90" && s.unit == u.name && s.sides == sides),
                    "no shipped sm_90 cubin of {} at {sides} sides",
                    u.name
                );
            }
        }
    }

    /// The units compiled for `UNSIDED` use nothing of `Sides`, so one cubin serves any run.
    #[test]
    fn units_compiled_once_take_no_sides() {
        for u in UNITS.iter().filter(|u| !u.sided) {
            for (file, text) in u.files {
                for word in ["Sides", "SideInts", "MAX_SIDES", "WITH_SIDES", "side_int"] {
                    assert!(
                        !text.contains(word),
                        "{file} uses {word}: mark its unit sided"
                    );
                }
            }
        }
        assert_eq!(UNSIDED, 1);
    }

    /// Each shipped cubin was built from today's source of its unit: rebuilt with
    /// `KVDIFF_UPDATE_CUBINS=1` (and NVRTC on the library path) where a kernel changed.
    #[test]
    fn shipped_cubins_are_built_from_todays_sources() {
        let update = std::env::var_os("KVDIFF_UPDATE_CUBINS").is_some();
        let mut stale = Vec::new();
        let mut sources = String::new();
        for s in all() {
            let unit = UNITS
                .iter()
                .find(|u| u.name == s.unit)
                .expect("a listed unit");
            let source = unit_source(unit, s.sides);
            let arch = target(unit, s.arch);
            let hash = source_hash(&source, &arch);
            let key = format!("{}-{}", s.unit, s.sides);
            sources.push_str(&format!("{key} {hash:016x}\n"));
            if recorded_hash(s.arch, s.unit, s.sides) == Some(hash) {
                // ELF, machine EM_CUDA (190).
                assert_eq!(&s.cubin[..4], b"\x7fELF", "{key}.cubin is not an ELF file");
                assert_eq!(u16::from_le_bytes([s.cubin[18], s.cubin[19]]), 190, "{key}");
                continue;
            }
            if !update {
                stale.push(key);
                continue;
            }
            assert!(
                super::super::libraries::nvrtc_loads(),
                "KVDIFF_UPDATE_CUBINS needs NVRTC (libnvrtc.so) on the library path"
            );
            let cubin = super::super::compile::nvrtc_cubin_for(&source, &arch)
                .unwrap_or_else(|e| panic!("{key}: {e}"));
            let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/kernels/cubin/");
            std::fs::write(format!("{dir}{}/{key}.cubin", s.arch), cubin).unwrap();
        }
        if update {
            let file = concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/kernels/cubin/sm_90/sources.txt"
            );
            std::fs::write(file, sources).unwrap();
        }
        assert!(
            stale.is_empty(),
            "kernels changed since their shipped sm_90 cubins were built ({}): rebuild them \
             with KVDIFF_UPDATE_CUBINS=1 cargo test --release --lib shipped_cubins (NVRTC on \
             the library path; see docs/gpu-backend.md)",
            stale.join(", ")
        );
    }
}
