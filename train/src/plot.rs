//! The training plot.
//!
//! In: the training loss, validation loss and validation BLEU as `(step, value)` series,
//! and a title. Out: a PNG with two panels sharing the step axis — train and validation
//! loss on top, validation BLEU below — written atomically ([`plot_training`]).
//!
//! Text is drawn with DejaVu Sans Mono, embedded in the binary (`train/assets/`, see
//! `DejaVuSansMono.LICENSE` there), so plotting needs no system fonts. Non-finite values
//! are skipped; empty series and single points are drawn as far as they go (an empty
//! panel still has its axes and legend).

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;

use plotters::prelude::*;

/// Width and height of the image, in pixels.
pub const SIZE: (u32, u32) = (1000, 700);

/// The embedded font (DejaVu Sans Mono; license in `train/assets/`).
static FONT: &[u8] = include_bytes!("../assets/DejaVuSansMono.ttf");

/// Values beyond this magnitude are drawn at it, so that a diverged run still plots.
const CLAMP: f64 = 1e12;

/// Why a plot could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot {action} `{path}`: {source}; check that the directory exists and is writable")]
    Io {
        action: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "cannot draw the plot `{path}`: {message}; check that the directory exists and is writable"
    )]
    Draw { path: PathBuf, message: String },
    #[error("the embedded plot font could not be loaded; this is a bug in kiln, please report it")]
    Font,
}

/// Registers the embedded font under plotters' family names, once per process.
fn register_font() -> Result<(), PlotError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        ["sans-serif", "serif", "monospace"]
            .iter()
            .all(|family| plotters::style::register_font(family, FontStyle::Normal, FONT).is_ok())
    });
    if ok {
        Ok(())
    } else {
        Err(PlotError::Font)
    }
}

/// The finite points of a series, as plot coordinates.
fn points(series: &[(u64, f64)]) -> Vec<(f64, f64)> {
    series
        .iter()
        .filter(|(_, y)| y.is_finite())
        .map(|&(step, y)| (step as f64, y.clamp(-CLAMP, CLAMP)))
        .collect()
}

/// `lo..hi` covering `values`, padded by `pad` of its width; a width of zero becomes a
/// unit around the value, and no values at all become `default`.
fn span(values: impl Iterator<Item = f64>, pad: f64, default: Range<f64>) -> Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo > hi {
        return default;
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(lo.abs()).max(1.0) {
        let half = (hi.abs() * 0.1).max(0.5);
        return (lo - half)..(hi + half);
    }
    let margin = (hi - lo) * pad;
    (lo - margin)..(hi + margin)
}

/// A tick label: plain with up to 4 decimals (trailing zeros dropped) for ordinary
/// magnitudes, scientific beyond `sci_from` or below 1e-3.
fn tick_label(v: f64, sci_from: f64) -> String {
    let a = v.abs();
    if a >= sci_from || (a < 1e-3 && a > 0.0) {
        return format!("{v:.1e}");
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    if s == "-0" {
        "0".to_string()
    } else {
        s.to_string()
    }
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// A temporary sibling of `path` ending in `.png`, which is how the encoder picks PNG.
fn temp_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_os_string();
    name.push(format!(
        ".tmp-{}-{}.png",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    PathBuf::from(name)
}

/// Draws the training plot to `path` as a PNG of [`SIZE`].
///
/// The write is atomic: the image goes to a temporary file in the same directory, which
/// is synced and renamed over `path`. On any error the temporary file is removed and
/// whatever was at `path` is left untouched.
pub fn plot_training(
    path: &Path,
    train_loss: &[(u64, f64)],
    val_loss: &[(u64, f64)],
    val_bleu: &[(u64, f64)],
    title: &str,
) -> Result<(), PlotError> {
    register_font()?;
    let train = points(train_loss);
    let val = points(val_loss);
    let bleu = points(val_bleu);

    let tmp = temp_path(path);
    // The backend writes the file when it is presented or dropped, so drawing finishes
    // (and the backend is gone) before the temporary file is judged.
    let drawn = draw(&tmp, &train, &val, &bleu, title).map_err(|message| PlotError::Draw {
        path: path.to_path_buf(),
        message,
    });
    let written = drawn.and_then(|()| sync_file(&tmp)).and_then(|()| {
        std::fs::rename(&tmp, path).map_err(|source| PlotError::Io {
            action: "rename the temporary plot over",
            path: path.to_path_buf(),
            source,
        })
    });
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    sync_parent_dir(path);
    Ok(())
}

fn sync_file(path: &Path) -> Result<(), PlotError> {
    std::fs::File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|source| PlotError::Io {
            action: "sync the temporary plot",
            path: path.to_path_buf(),
            source,
        })
}

/// Makes a rename durable where the platform allows it (best effort).
fn sync_parent_dir(path: &Path) {
    #[cfg(unix)]
    {
        let dir = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Ok(d) = std::fs::File::open(dir) {
            let _ = d.sync_all();
        }
    }
    #[cfg(not(unix))]
    let _ = path;
}

const TRAIN_COLOR: RGBColor = RGBColor(31, 119, 180);
const VAL_COLOR: RGBColor = RGBColor(214, 39, 40);
const BLEU_COLOR: RGBColor = RGBColor(44, 160, 44);

/// One line series with its legend entry; validation series (few points) get markers.
fn line<'a, DB: DrawingBackend + 'a>(
    chart: &mut ChartContext<
        'a,
        DB,
        Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
    >,
    data: &[(f64, f64)],
    color: RGBColor,
    label: &str,
    markers: bool,
) -> Result<(), String> {
    let style = color.stroke_width(2);
    let series =
        LineSeries::new(data.iter().copied(), style).point_size(if markers { 3 } else { 0 });
    chart
        .draw_series(series)
        .map_err(|e| e.to_string())?
        .label(label)
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    // A lone point draws no line segment: mark it so it shows.
    if data.len() == 1 && !markers {
        chart
            .draw_series(data.iter().map(|&p| Circle::new(p, 3, color.filled())))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

fn draw(
    tmp: &Path,
    train: &[(f64, f64)],
    val: &[(f64, f64)],
    bleu: &[(f64, f64)],
    title: &str,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<_>| e.to_string();
    let root = BitMapBackend::new(tmp, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled(title, ("sans-serif", 22)).map_err(err)?;
    let (top, bottom) = root.split_vertically(root.dim_in_pixel().1 / 2);

    let steps = span(
        train.iter().chain(val).chain(bleu).map(|p| p.0),
        0.0,
        0.0..1.0,
    );
    let loss = span(train.iter().chain(val).map(|p| p.1), 0.05, 0.0..1.0);
    let bleu_range = {
        let r = span(bleu.iter().map(|p| p.1), 0.05, 0.0..1.0);
        r.start.min(0.0)..r.end
    };
    let step_label = |x: &f64| tick_label(x.round(), 1e7);
    let value_label = |y: &f64| tick_label(*y, 1e5);

    let mut chart = ChartBuilder::on(&top)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(steps.clone(), loss)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .x_label_formatter(&step_label)
        .y_label_formatter(&value_label)
        .draw()
        .map_err(err)?;
    line(&mut chart, train, TRAIN_COLOR, "train loss", false)?;
    line(&mut chart, val, VAL_COLOR, "validation loss", true)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;

    let mut chart = ChartBuilder::on(&bottom)
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(steps, bleu_range)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("BLEU")
        .x_label_formatter(&step_label)
        .y_label_formatter(&value_label)
        .draw()
        .map_err(err)?;
    line(&mut chart, bleu, BLEU_COLOR, "validation BLEU", true)?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;

    root.present().map_err(err)
}
