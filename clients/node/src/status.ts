// The standard error details of a failed call: the google.rpc.Status a kvmesh
// server sends in the grpc-status-details-bin trailer, with its details
// (google.rpc.BadRequest for INVALID_ARGUMENT, google.rpc.RetryInfo when the
// server says how long to wait) unpacked. The three messages are described
// here as a file descriptor with the names and field numbers of googleapis'
// google/rpc/status.proto and error_details.proto (the fields kvmesh sends;
// others are kept as unknown fields), so protobuf-es decodes them like the
// generated messages: no further dependency.

import { create, createFileRegistry, fromBinary, type DescFile, type DescMessage, type Message } from '@bufbuild/protobuf';
import {
  FieldDescriptorProto_Label as Label,
  FieldDescriptorProto_Type as Type,
  FileDescriptorProtoSchema,
  anyUnpack,
  file_google_protobuf_any,
  file_google_protobuf_duration,
  type Any,
  type Duration,
} from '@bufbuild/protobuf/wkt';
import type * as grpc from '@grpc/grpc-js';

/** Trailing metadata key of the serialized google.rpc.Status. */
export const STATUS_DETAILS_METADATA = 'grpc-status-details-bin';

/** Prefix of the type URL of a packed google.protobuf.Any. */
const TYPE_URL_PREFIX = 'type.googleapis.com/';

const string = (name: string, number: number) => ({ name, number, type: Type.STRING, label: Label.OPTIONAL });
const message = (name: string, number: number, typeName: string, label: Label) => ({
  name,
  number,
  type: Type.MESSAGE,
  typeName,
  label,
});

const RPC_FILE = create(FileDescriptorProtoSchema, {
  name: 'kvmesh/node-client/google_rpc_status.proto',
  package: 'google.rpc',
  syntax: 'proto3',
  dependency: ['google/protobuf/any.proto', 'google/protobuf/duration.proto'],
  messageType: [
    {
      name: 'Status',
      field: [
        { name: 'code', number: 1, type: Type.INT32, label: Label.OPTIONAL },
        string('message', 2),
        message('details', 3, '.google.protobuf.Any', Label.REPEATED),
      ],
    },
    {
      name: 'BadRequest',
      field: [message('field_violations', 1, '.google.rpc.BadRequest.FieldViolation', Label.REPEATED)],
      nestedType: [
        { name: 'FieldViolation', field: [string('field', 1), string('description', 2), string('reason', 3)] },
      ],
    },
    {
      name: 'RetryInfo',
      field: [message('retry_delay', 1, '.google.protobuf.Duration', Label.OPTIONAL)],
    },
  ],
});

const IMPORTS: Record<string, DescFile> = {
  'google/protobuf/any.proto': file_google_protobuf_any,
  'google/protobuf/duration.proto': file_google_protobuf_duration,
};

const registry = createFileRegistry(RPC_FILE, (name) => IMPORTS[name]);

function messageDesc(typeName: string): DescMessage {
  const desc = registry.getMessage(typeName);
  if (!desc) throw new Error(`${typeName} is not described`);
  return desc;
}

const STATUS = messageDesc('google.rpc.Status');

type StatusMessage = Message<'google.rpc.Status'> & { code: number; message: string; details: Any[] };

/** One field violation of a google.rpc.BadRequest. */
export interface FieldViolation {
  field: string;
  description: string;
}

/** A detail of a Status: its type name and its fields (protobuf-es names), or `value` (bytes) for another type. */
export interface StatusDetail {
  type: string;
  [field: string]: unknown;
}

/** A decoded google.rpc.Status. */
export interface RichStatus {
  code: number;
  message: string;
  details: StatusDetail[];
}

/** A failed call as grpc-js reports it (only its trailing metadata is read). */
export type CallError = Partial<Pick<grpc.ServiceError, 'metadata'>> | null | undefined;

/** A packed detail as `{ type, ...fields }`, or `{ type, value }` (bytes) for a type not described here. */
function unpack(any: Any): StatusDetail {
  const type = any.typeUrl.startsWith(TYPE_URL_PREFIX) ? any.typeUrl.slice(TYPE_URL_PREFIX.length) : any.typeUrl;
  const message = registry.getMessage(type) ? anyUnpack(any, registry) : undefined;
  if (!message) return { type, value: Buffer.from(any.value) };
  const { $typeName: _typeName, ...fields } = message as Message & Record<string, unknown>;
  return { type, ...fields };
}

/**
 * The google.rpc.Status of a failed call, `{ code, message, details }` with
 * each detail unpacked (see `unpack`); null when the error carries none.
 */
export function richStatus(err: CallError): RichStatus | null {
  const values = err && err.metadata ? err.metadata.get(STATUS_DETAILS_METADATA) : [];
  if (!values.length) return null;
  const raw = values[0];
  const status = fromBinary(STATUS, typeof raw === 'string' ? Buffer.from(raw, 'binary') : raw) as StatusMessage;
  return { code: status.code, message: status.message, details: status.details.map(unpack) };
}

/** The field violations of an INVALID_ARGUMENT, `[{ field, description }]` (empty when none). */
export function fieldViolations(err: CallError): FieldViolation[] {
  const status = richStatus(err);
  if (!status) return [];
  return status.details
    .filter((d) => d.type === 'google.rpc.BadRequest')
    .flatMap((d) => d.fieldViolations as FieldViolation[])
    .map(({ field, description }) => ({ field, description }));
}

/** Milliseconds the server asks the caller to wait before retrying (RetryInfo), or null. */
export function retryDelayMs(err: CallError): number | null {
  const status = richStatus(err);
  const info = status && status.details.find((d) => d.type === 'google.rpc.RetryInfo');
  const delay = info && (info.retryDelay as Duration | undefined);
  if (!delay) return null;
  return Number(delay.seconds) * 1000 + delay.nanos / 1e6;
}
