//! Builtins: numbers, dims, stacks and initializers.

use super::*;

pub(super) fn call(e: &mut Elab, name: &str, a: &Args) -> R<Value> {
    match name {
        "dim" => {
            let (x, _) = a.tensor("x")?;
            let ty = e.ty(x);
            let ax = a.axis("axis", ty.shape.rank())?.expect("required");
            Ok(Value::from_dim(ty.shape.dims()[ax].clone()))
        }
        "rank" => {
            let (x, _) = a.tensor("x")?;
            Ok(Value::Int(e.ty(x).shape.rank() as i64))
        }
        "float" => Ok(Value::Float(a.number("x")?)),
        "int" => match a.req("x") {
            (Value::Int(v), _) => Ok(Value::Int(*v)),
            (Value::Float(v), s) if v.fract() == 0.0 && v.abs() < 9.0e15 => {
                let _ = s;
                Ok(Value::Int(*v as i64))
            }
            (Value::Float(v), s) => Err(Diag::new(
                "kiln::type",
                format!("int({v}): not a whole number"),
            )
            .at(*s, "has a fraction")
            .help("round it yourself, e.g. write the whole number you mean")),
            _ => Err(a.wrong("x", "a number")),
        },
        "decoding" => Ok(Value::Bool(e.mode == Mode::Decode)),
        "repeat" => {
            let n = a.int("n")?;
            if n < 0 {
                return Err(
                    Diag::new("kiln::range", format!("`repeat` needs n >= 0, got {n}"))
                        .at(a.req("n").1, "negative"),
                );
            }
            if n > MAX_REPEAT {
                return Err(Diag::new(
                    "kiln::range",
                    format!("`repeat` makes at most {MAX_REPEAT} copies, got {n}"),
                )
                .at(a.req("n").1, "too many")
                .help("the paper stacks 6 layers (base and big); check the value of n"));
            }
            match a.req("layer") {
                (Value::Partial(p), _) if p.repeat.is_none() => Ok(Value::Partial(Rc::new(Partial {
                    layer: p.layer.clone(),
                    hyper: p.hyper.clone(),
                    deferred: p.deferred.clone(),
                    repeat: Some(n as usize),
                }))),
                (v, s) => Err(Diag::new(
                    "kiln::type",
                    format!("`repeat` needs a layer with its hyper-parameters bound, got {}", v.kind()),
                )
                .at(*s, format!("this is {}", v.kind()))
                .help("write `repeat(n, encoder_layer(d_model = 512, ...))`: each copy gets its own weights")),
            }
        }
        "normal" => {
            let std = a.number("std")?;
            if std.is_nan() || std < 0.0 {
                return Err(
                    Diag::new("kiln::range", format!("normal needs std >= 0, got {std}"))
                        .at(a.req("std").1, ""),
                );
            }
            Ok(Value::Init(Init::Normal {
                std: Float::new(std),
            }))
        }
        "uniform" => Ok(Value::Init(Init::Uniform {
            a: Float::new(a.number("a")?),
        })),
        "constant" => Ok(Value::Init(Init::Constant(Float::new(a.number("value")?)))),
        "xavier_uniform" | "zeros" | "ones" => {
            Ok(Value::Init(named_init(name).expect("named init")))
        }
        _ => unreachable!("builtin `{name}` is not values"),
    }
}
