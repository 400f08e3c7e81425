//! Profiled runs: marks in the stream around each phase, read back at the end as
//! timings per phase, the GPU's idle time and the host's issue time.

use kiln_compiler::reference::ExecError;

use crate::cuda::device::{self};
use crate::executor::{Product, Timing};

/// A device failure (driver, cuBLAS, a launch) as an execution error.
pub(crate) fn dev_err(message: String) -> ExecError {
    ExecError::Node {
        node: "the GPU".into(),
        message,
    }
}

/// What a profiled run calls per timed part.
pub(crate) type Recorder<'a> = &'a mut dyn FnMut(&Timing<'_>);

/// The phases of a profiled run — the upload, each kernel (with the copies it reads),
/// the download — between marks in the stream ([`device::Mark`]), recorded without
/// waiting for the device so the run is timed as it runs unprofiled.
pub(crate) struct Phases {
    pub(crate) on: bool,
    /// `(what, begin, end, product)`, in issue order.
    pub(crate) done: Vec<(String, device::Mark, device::Mark, Option<Product>)>,
    pub(crate) open: Option<device::Mark>,
    /// When the host began issuing each phase's work, and how long that took in all.
    pub(crate) issue: (std::time::Instant, f64),
}

/// [`Phases::report`]'s name for the time the GPU spent between phases: waiting for
/// the host to issue the next launch.
pub const GPU_IDLE: &str = "[gpu idle, waiting for the host]";
/// [`Phases::report`]'s name for the host's time issuing the phases (it overlaps the
/// GPU's work, except where the host waits for the device).
pub const HOST_ISSUE: &str = "[host issuing the launches]";

impl Phases {
    pub(crate) fn new(on: bool) -> Phases {
        Phases {
            on,
            done: Vec::new(),
            open: None,
            issue: (std::time::Instant::now(), 0.0),
        }
    }

    pub(crate) fn begin(&mut self, dev: &device::Device) -> Result<(), String> {
        if self.on {
            self.issue.0 = std::time::Instant::now();
            self.open = Some(dev.mark()?);
        }
        Ok(())
    }

    pub(crate) fn end(&mut self, dev: &device::Device, what: &str) -> Result<(), String> {
        self.end_product(dev, what, None)
    }

    /// [`Phases::end`] of a kernel that ran a matrix product of this shape.
    pub(crate) fn end_product(
        &mut self,
        dev: &device::Device,
        what: &str,
        product: Option<Product>,
    ) -> Result<(), String> {
        if let Some(begin) = self.open.take() {
            let end = dev.mark()?;
            self.issue.1 += self.issue.0.elapsed().as_secs_f64();
            self.done.push((what.to_string(), begin, end, product));
        }
        Ok(())
    }

    /// After the device has reached every mark: a [`Timing`] per phase (the device's
    /// time from its begin to its end mark), then [`GPU_IDLE`] (the sum of the gaps
    /// between one phase's end and the next one's begin) and [`HOST_ISSUE`].
    pub(crate) fn report(&self, rec: &mut dyn FnMut(&Timing<'_>)) -> Result<(), String> {
        let mut idle = 0.0;
        for (i, (what, begin, end, product)) in self.done.iter().enumerate() {
            rec(&Timing {
                what,
                seconds: begin.seconds_to(end)?.max(0.0),
                product: *product,
            });
            if let Some((_, _, before, _)) = i.checked_sub(1).map(|j| &self.done[j]) {
                idle += before.seconds_to(begin)?.max(0.0);
            }
        }
        if !self.done.is_empty() {
            for (what, seconds) in [(GPU_IDLE, idle), (HOST_ISSUE, self.issue.1)] {
                rec(&Timing {
                    what,
                    seconds,
                    product: None,
                });
            }
        }
        Ok(())
    }
}
