//! One error type for everything a user can get wrong, and the exit codes CI relies on.

use std::path::{Path, PathBuf};

/// Exit code: the run finished and found nothing wrong.
pub const EXIT_OK: i32 = 0;
/// Exit code: a divergence was found.
pub const EXIT_DIVERGED: i32 = 1;
/// Exit code: bad input or usage; the message names the file or flag and the fix.
pub const EXIT_BAD_INPUT: i32 = 2;
/// Exit code: a bug in kvdiff itself.
pub const EXIT_INTERNAL: i32 = 3;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Something the user supplied is wrong. `what` says what, `fix` what to do about it.
    #[error("{}: {what}\n  fix: {fix}", .path.display())]
    Input {
        path: PathBuf,
        what: String,
        fix: String,
    },
    /// A flag or argument is wrong (no file involved).
    #[error("{flag}: {what}\n  fix: {fix}")]
    Usage {
        flag: String,
        what: String,
        fix: String,
    },
    /// The reference backend's own error, measured against the f64 oracle, is beyond rounding:
    /// the code every path shares computes something else, so no tolerance is learned from it.
    #[error("calibration refused: {0}\n  fix: the reference forward pass is wrong; `kvdiff compare --tolerance fixed --atol 0 --rtol 1e-5` still runs, and the HF conformance tests show where")]
    Calibration(String),
    /// An invariant of kvdiff itself broke.
    #[error("internal error: {0}")]
    Internal(String),
}

impl Error {
    pub fn input(path: impl AsRef<Path>, what: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::Input {
            path: path.as_ref().to_path_buf(),
            what: what.into(),
            fix: fix.into(),
        }
    }

    pub fn usage(flag: impl Into<String>, what: impl Into<String>, fix: impl Into<String>) -> Self {
        Error::Usage {
            flag: flag.into(),
            what: what.into(),
            fix: fix.into(),
        }
    }

    pub fn exit_code(&self) -> i32 {
        match self {
            Error::Input { .. } | Error::Usage { .. } => EXIT_BAD_INPUT,
            Error::Calibration(_) => EXIT_DIVERGED,
            Error::Internal(_) => EXIT_INTERNAL,
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// An error found where no `Result` reaches (a GPU allocation deep inside a forward pass),
/// unwound as a panic's payload by `raise` and reported by `main` as the error it is, with its
/// exit code, instead of as a bug.
pub struct Raised(pub Error);

/// Unwinds with `e` as the payload (see `Raised`).
pub fn raise(e: Error) -> ! {
    std::panic::panic_any(Raised(e))
}

/// What a thread's panic (`what` names the work) means to the caller: the error it `raise`d,
/// else an internal error.
pub fn panic_error(payload: Box<dyn std::any::Any + Send>, what: &str) -> Error {
    raised(payload).unwrap_or_else(|_| Error::Internal(format!("{what} panicked")))
}

/// The error a caught panic `raise`d, or the payload back where it was another panic.
pub fn raised(
    payload: Box<dyn std::any::Any + Send>,
) -> std::result::Result<Error, Box<dyn std::any::Any + Send>> {
    payload.downcast::<Raised>().map(|r| r.0)
}

#[cfg(test)]
mod tests {
    use super::{raise, raised, Error, EXIT_BAD_INPUT};

    #[test]
    fn a_raised_error_comes_back_whole_and_other_panics_stay_panics() {
        let quiet = std::panic::take_hook();
        std::panic::set_hook(Box::new(|_| {}));
        let caught = std::panic::catch_unwind(|| -> () {
            raise(Error::usage(
                "--backend cuda",
                "out of memory",
                "a shorter prompt",
            ))
        });
        let other = std::panic::catch_unwind(|| panic!("a bug"));
        std::panic::set_hook(quiet);
        let e = raised(caught.unwrap_err()).expect("the raised error");
        assert_eq!(e.exit_code(), EXIT_BAD_INPUT);
        assert_eq!(
            e.to_string(),
            "--backend cuda: out of memory\n  fix: a shorter prompt"
        );
        let p = raised(other.unwrap_err()).expect_err("a panic of another kind");
        assert_eq!(p.downcast_ref::<&str>(), Some(&"a bug"));
    }
}
