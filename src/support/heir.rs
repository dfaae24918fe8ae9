//! The GPU's teardown, handed to an heir. Once a process that opened the GPU calls `_exit`, the
//! kernel unmaps its memory and closes the driver's files before the parent's `wait` returns:
//! the driver tears the context down there, 0.13–0.15 s whatever the memory held. An heir that
//! shares the address space and holds only the driver's files takes that teardown over: the
//! command's own exit returns at once, and the heir, ending once every thread of the command has,
//! tears the context down after the caller has the exit code and every pipe's end.

use std::ffi::c_void;

/// The files whose release is the driver's teardown.
const DRIVER_FILES: &str = "/dev/nvidia";

/// What the heir needs, read before it starts: it allocates nothing and reads no file.
struct Inheritance {
    parent: libc::pid_t,
    /// Every descriptor but the driver's, closed in the heir's copy of the table so that no
    /// pipe or file outlives the command.
    close: Vec<libc::c_int>,
}

/// The descriptors an heir closes: all but the driver's. None when the driver holds no file,
/// so there is no teardown to hand over.
pub(crate) fn others(open: &[(libc::c_int, String)]) -> Option<Vec<libc::c_int>> {
    if !open
        .iter()
        .any(|(_, target)| target.starts_with(DRIVER_FILES))
    {
        return None;
    }
    Some(
        open.iter()
            .filter(|(_, target)| !target.starts_with(DRIVER_FILES))
            .map(|&(fd, _)| fd)
            .collect(),
    )
}

fn open_files() -> Vec<(libc::c_int, String)> {
    let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    dir.filter_map(|entry| {
        let entry = entry.ok()?;
        let fd = entry.file_name().to_str()?.parse().ok()?;
        let target = std::fs::read_link(entry.path()).ok()?;
        Some((fd, target.to_string_lossy().into_owned()))
    })
    .collect()
}

extern "C" fn heir(arg: *mut c_void) -> libc::c_int {
    // Safety: `arg` is the leaked `Inheritance` of `hand_over`; the heir's calls are system
    // calls that allocate nothing.
    unsafe {
        let inheritance = &*(arg as *const Inheritance);
        for signal in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGPIPE] {
            libc::signal(signal, libc::SIG_DFL);
        }
        for &fd in &inheritance.close {
            libc::close(fd);
        }
        // The heir is adopted elsewhere only once the command's last thread has ended; a death
        // signal would come with its first, and the heir ending before the others would leave
        // the teardown to the last of them. Polled: the wait is the command's exit, a few ms.
        let pause = libc::timespec {
            tv_sec: 0,
            tv_nsec: 500_000,
        };
        while libc::getppid() == inheritance.parent {
            libc::nanosleep(&pause, std::ptr::null_mut());
        }
        libc::_exit(0)
    }
}

/// Starts an heir to the driver's teardown, if the process holds the driver's files. The
/// caller ends right after; on any failure it ends as before, tearing down itself.
pub(crate) fn hand_over() {
    let Some(close) = others(&open_files()) else {
        return;
    };
    const STACK: usize = 64 * 1024;
    let stack = Box::leak(vec![0u8; STACK].into_boxed_slice());
    let inheritance = Box::leak(Box::new(Inheritance {
        // Safety: getpid has no preconditions.
        parent: unsafe { libc::getpid() },
        close,
    }));
    // Safety: the stack and the inheritance are leaked, so they outlive the heir; the heir
    // shares the address space (CLONE_VM) but not the descriptor table, and its exit signal
    // lets whoever adopts it reap it.
    unsafe {
        let top = stack.as_mut_ptr().add(STACK) as *mut c_void;
        libc::clone(
            heir,
            top,
            libc::CLONE_VM | libc::SIGCHLD,
            inheritance as *mut Inheritance as *mut c_void,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::others;

    fn table(entries: &[(i32, &str)]) -> Vec<(i32, String)> {
        entries.iter().map(|&(fd, t)| (fd, t.to_string())).collect()
    }

    #[test]
    fn a_process_without_the_driver_hands_nothing_over() {
        let open = table(&[(0, "/dev/pts/0"), (1, "pipe:[12]"), (3, "/tmp/x")]);
        assert_eq!(others(&open), None);
    }

    #[test]
    fn the_heir_keeps_only_the_driver_files() {
        let open = table(&[
            (0, "/dev/null"),
            (1, "pipe:[12]"),
            (2, "pipe:[13]"),
            (3, "/dev/nvidiactl"),
            (4, "/dev/nvidia0"),
            (5, "anon_inode:[eventfd]"),
            (6, "/dev/nvidia-uvm"),
        ]);
        assert_eq!(others(&open), Some(vec![0, 1, 2, 5]));
    }
}
