//! The emulated device's own tests: its library cache and its fibers.

use super::*;

/// Pruning removes the cache's libraries unused for longer than the limit and keeps
/// the rest and anything that is not the cache's.
#[test]
fn pruning_removes_only_stale_libraries() {
    let dir = std::env::temp_dir().join(format!("kiln-emu-prune-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let old = std::time::SystemTime::now() - std::time::Duration::from_secs(20 * 86_400);
    for (name, stale) in [
        ("a.so", true),
        ("b.so", false),
        ("c.so.tmp", true),
        ("keep.txt", true),
    ] {
        let f = std::fs::File::create(dir.join(name)).unwrap();
        if stale {
            f.set_modified(old).unwrap();
        }
    }
    prune(&dir, CACHE_DAYS);
    let mut left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, ["b.so", "keep.txt"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A kernel that needs its barriers (a block reverses a shared array, doubles it,
/// rotates it, and adds a shuffle partner's index) gives the same values under the
/// fiber shim with either switch: the x86-64 one (where it is the one used) and
/// `ucontext`'s (the one used elsewhere), over three blocks of 64 fibers.
#[test]
fn fibers_keep_the_barriers_with_either_switch() {
    const KERNEL: &str = r#"
__global__ void k(int* out) {
__shared__ int s[64];
const unsigned t = threadIdx.x, n = blockDim.x;
s[t] = (int)(blockIdx.x * 100u + t);
__syncthreads();
const int v = s[n - 1u - t];
__syncthreads();
s[t] = 2 * v;
__syncthreads();
const float partner = __shfl_xor_sync(~0u, (float)t, 1);
out[blockIdx.x * n + t] = s[(t + 1u) % n] + (int)partner;
}
int main() {
std::vector<int> out(3 * 64);
kiln_launch(3, 64, [&]() { k(out.data()); });
for (int v : out) std::printf("%d\n", v);
}
"#;
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "g++".to_string());
    if !Command::new(&cxx)
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
    {
        println!("skipped: no `{cxx}` to compile the fiber shim");
        return;
    }
    let want: Vec<i32> = (0..3)
        .flat_map(|b| {
            (0..64).map(move |t: i32| {
                let r = (t + 1) % 64;
                2 * (b * 100 + 63 - r) + (t ^ 1)
            })
        })
        .collect();
    let dir = std::env::temp_dir().join(format!("kiln-emu-fibers-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let slow = FIBER_SHIM.replace("#if defined(__x86_64__)", "#if 0");
    assert_ne!(slow, FIBER_SHIM);
    for (name, shim) in [("fast", FIBER_SHIM), ("ucontext", slow.as_str())] {
        let src = dir.join(format!("{name}.cpp"));
        let exe = dir.join(name);
        std::fs::write(&src, format!("{shim}\n{KERNEL}")).unwrap();
        let built = Command::new(&cxx)
            .args(["-std=c++20", "-O1", "-w"])
            .arg(&src)
            .arg("-o")
            .arg(&exe)
            .output()
            .unwrap();
        assert!(
            built.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&built.stderr)
        );
        let run = Command::new(&exe).output().unwrap();
        assert!(run.status.success(), "{name}: {run:?}");
        let got: Vec<i32> = String::from_utf8_lossy(&run.stdout)
            .lines()
            .map(|l| l.parse().unwrap())
            .collect();
        assert_eq!(got, want, "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
